"""The SFT recipe: config in, a trained model in ``RUN_DIR/final`` out."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tether.builders import build_model_and_tokenizer, build_sft_data, seed_everything, torch_threads
from tether.config import ExperimentConfig
from tether.data.cursor import DataCursor
from tether.data.tokenize import SFTExample, tokenize_sft
from tether.errors import DataError
from tether.metrics import MetricsWriter
from tether.models.checkpoint import save_checkpoint
from tether.progress import make_progress
from tether.training.optim import build_optimizer, build_scheduler
from tether.training.sft import SFTTrainer


@dataclass(slots=True)
class SFTResult:
    run_dir: Path
    final_dir: Path
    eval_losses: list[tuple[int, float]]  # (step, held-out loss), first entry before training
    model: Any
    tokenizer: Any


def _tokenize_all(records: list[Any], tokenizer: Any, max_len: int, source: str | None,
                  limit: str = "data.max_seq_len") -> list[SFTExample]:
    """Tokenized examples; a record that cannot be is a one-line error naming its source."""
    try:
        return [tokenize_sft(r, tokenizer, max_len, limit) for r in records]
    except DataError as exc:  # a row read from a file names it already ("file.jsonl:4: ...")
        message = str(exc)
        is_placed = not source or message.startswith((str(source), str(Path(source))))
        raise DataError(message if is_placed else f"{source}: {message}") from None


def _fit_context(records: list[Any], tokenizer: Any, max_len: int, context: int,
                 source: str | None) -> list[SFTExample]:
    """Examples cut at ``max_len`` (data.max_seq_len) or the model's context, whichever is shorter,
    with one warning that counts the examples cut (their ends and eos are never trained; past the
    context, a position would never have been trained either)."""
    if context < max_len:
        limit = "the model's context, max_position_embeddings"
        what = (f"the model's context of {context} tokens (max_position_embeddings, or as its rope_scaling "
                f"extends it; data.max_seq_len={max_len})")
    else:
        limit, what = "data.max_seq_len", f"data.max_seq_len={max_len} tokens"
    examples = _tokenize_all(records, tokenizer, min(max_len, context), source, limit)
    cut = [getattr(r, "where", "") or f"row {i}" for i, (r, e) in enumerate(zip(records, examples)) if e.is_cut]
    if cut:
        print(f"warning: {source}: {len(cut)} of {len(examples)} examples are longer than {what}: cut at "
              f"{min(max_len, context)}, losing their ends and eos (the first: {cut[0]})",
              file=sys.stderr, flush=True)
    return examples


def run_sft(config: ExperimentConfig, run_dir: Path, model: Any = None, tokenizer: Any = None) -> SFTResult:
    seed_everything(config.seed)
    if model is None:
        model, tokenizer = build_model_and_tokenizer(config.model, config.init_from, config.seed)
    train_records, eval_records, _ = build_sft_data(config.data, config.seed)
    context = model.config.context_length
    train = _fit_context(train_records, tokenizer, config.data.max_seq_len, context,
                         config.data.task or config.data.train)
    held_out = _fit_context(eval_records, tokenizer, config.data.max_seq_len, context,
                            config.data.task or config.data.eval)
    t = config.trainer
    optimizer = build_optimizer(model.parameters(), t.lr, t.weight_decay, t.betas)
    scheduler = build_scheduler(optimizer, warmup_steps=t.warmup_steps, max_steps=t.max_steps,
                                schedule=t.schedule, min_lr_ratio=t.min_lr_ratio)
    trainer = SFTTrainer(model, optimizer, scheduler, micro_batch_tokens=t.micro_batch_tokens,
                         grad_clip=t.grad_clip)
    cursor: DataCursor[SFTExample] = DataCursor(train, seed=config.seed)
    progress = make_progress(config.logging.progress, t.max_steps, "sft", config.logging.log_every)
    with torch_threads(t.num_threads):
        eval_losses = [(0, trainer.eval_loss(held_out))] if held_out else []
        with MetricsWriter(run_dir, progress) as writer:
            for step in range(1, t.max_steps + 1):
                metrics: dict[str, Any] = trainer.train_step(cursor.take(t.batch_size))
                metrics["epoch"] = cursor.state.epoch
                is_eval_step = held_out and ((t.eval_every and step % t.eval_every == 0) or step == t.max_steps)
                if is_eval_step:
                    metrics["eval/loss"] = trainer.eval_loss(held_out)
                    eval_losses.append((step, metrics["eval/loss"]))
                if step == 1 and eval_losses:  # the curve's start; written with step 1, so that a run
                    writer.log(0, {"eval/loss": eval_losses[0][1]})  # stopped before it may reuse --out
                writer.log(step, metrics)
    final_dir = run_dir / "final"
    save_checkpoint(model, tokenizer, final_dir, source=config.init_from or config.model.path)
    return SFTResult(run_dir, final_dir, eval_losses, model, tokenizer)

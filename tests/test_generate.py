"""`tether generate`: the output format, greedy parity with transformers, per-line overrides."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from helpers.gpu import on_gpu
from helpers.hf_tiny import make_hf_checkpoint
from tether.data.records import PromptRecord
from tether.errors import DataError
from tether.generate import request_params, setting_like_fields


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_hf_checkpoint(tmp_path_factory.mktemp("gen"), "llama", hidden_size=32, num_layers=2)


def _run(args, cwd):
    # On the CPU unless a test says otherwise: the bit-exact tests hold there (batch invariance), and a
    # developer's GPU would be --device auto's choice.
    args = [*args, "--device", "cpu"] if "--device" not in args else args
    return subprocess.run([sys.executable, "-m", "tether.cli", "generate", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=300)


def _prompts(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_greedy_equals_transformers_and_format(model_dir, tmp_path):
    prompts = _prompts(tmp_path / "p.jsonl", [{"prompt": "12+34="}, {"prompt": "hello wor", "max_new_tokens": 5}])
    out = tmp_path / "out.jsonl"
    result = _run(["--model", str(model_dir), "--prompts", str(prompts), "--n", "2", "--max-new-tokens", "12",
                   "--temperature", "0", "--seed", "0", "--output", str(out)], tmp_path)
    assert result.returncode == 0, result.stderr
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [(x["prompt_index"], x["sample_index"]) for x in lines] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for x in lines:
        assert set(x) >= {"prompt_index", "sample_index", "text", "token_ids", "logprobs", "finish_reason"}
        assert len(x["token_ids"]) == len(x["logprobs"])
    assert len(lines[2]["token_ids"]) <= 5  # the line's own max_new_tokens

    hf = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    from tether.data.tokenize import encode_prompt
    from tether.models.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    ids = torch.tensor([encode_prompt(tokenizer, "12+34=")])
    with torch.no_grad():
        expected = hf.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=tokenizer.eos_token_id,
                               pad_token_id=tokenizer.pad_token_id)[0, ids.shape[1]:].tolist()
    if tokenizer.eos_token_id in expected:  # transformers keeps the eos token, as tether does
        expected = expected[: expected.index(tokenizer.eos_token_id) + 1]
    assert lines[0]["token_ids"] == expected
    assert lines[1]["token_ids"] == expected


@pytest.mark.parametrize(("line", "needle"), [
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "x", "seed": float("nan")}, "p.jsonl:3: field 'seed' must be a finite number"),  # the file's line
    ({"prompt": "x", "max_new_tokens": float("inf")}, "field 'max_new_tokens' must be a finite number"),
    ({"prompt": "x", "temprature": 0}, "p.jsonl:3: unknown field 'temprature' (did you mean 'temperature'?)"),
    ({"prompt": "x", "top_p": 10**400}, "p.jsonl:3: field 'top_p' is out of range"),
    ({"prompt": "x", "stop": ["a", 5]}, "p.jsonl:3: field 'stop' must be a non-empty string or a list of them"),
    ({"prompt": "x", "stops": "a"}, "unknown field 'stops' (did you mean 'stop'?)"),
    ({"prompt": "x", "temp": 0}, "p.jsonl:3: field 'temp' is not a tether sampling setting (tether's name is "
                                 "'temperature')"),
    ({"prompt": "x", "repetition_penalty": 1.1}, "field 'repetition_penalty' is not a tether sampling setting"),
    ({"prompt": "x", "max_length": 2}, "field 'max_length' is not a tether sampling setting"),
    ({"prompt": "x", "min_tokens": 3}, "field 'min_tokens' is not a tether sampling setting"),
    ({"prompt": "x", "stop": "a", "stop_strings": "b"}, "give 'stop' or 'stop_strings', not both"),
    ({"prompt": "x", "stop_token_ids": [2, "a"]}, "field 'stop_token_ids' must be a list of token ids"),
    ({"prompt": "x", "n": 10**6}, "p.jsonl:3: n must be in [1, 65536]"),
    ({"prompt": "x", "seed": -1}, "p.jsonl:3: seed must be in [0, 2**64), got -1"),  # not llama.cpp's "random"
    ({"prompt": "x", "seed": 2**64}, "p.jsonl:3: seed must be in [0, 2**64)"),  # it replayed seed 0
    ({"prompt": "x", "eos_token_id": 5}, "field 'eos_token_id' is not a tether sampling setting (tether's name "
                                         "is 'stop_token_ids')"),
    ({"prompt": "x", "n_predict": 4}, "(tether's name is 'max_new_tokens')"),
    ({"prompt": "x", "sampling_params": {"temperature": 0}}, "field 'sampling_params' nests sampling settings"),
])
def test_bad_prompt_line_is_one_line_error(model_dir, tmp_path, line, needle):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "ok"}) + "\n\n" + json.dumps(line) + "\n")  # a blank line between
    result = _run(["--model", str(model_dir), "--prompts", str(prompts), "--output", str(tmp_path / "o.jsonl")],
                  tmp_path)
    assert result.returncode == 2
    assert needle in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize(("key", "hint"), [
    ("num_generations", "tether's name is 'n'"),  # TRL: 1 sample instead of 8, silently, before
    ("max_completion_length", "tether's name is 'max_new_tokens'"),
    ("max_output_tokens", "tether's name is 'max_new_tokens'"),  # OpenAI's Responses API
    ("maxTokens", "tether's name is 'max_new_tokens'"), ("topP", "tether's name is 'top_p'"),  # camelCase APIs
    ("minP", "tether's name is 'min_p'"), ("stopSequences", "tether's name is 'stop'"),
    ("prompt_token_ids", "prompts are text or chat messages in 'prompt'"),  # vLLM's TokensPrompt
])
def test_other_tools_names_for_settings_are_refused(key, hint):
    record = PromptRecord("x", fields={key: 8}, where="p.jsonl:4")
    with pytest.raises(DataError, match=f"p.jsonl:4: field '{key}' is not a tether sampling setting"):
        request_params(record, {"n": 1}, "p.jsonl")
    with pytest.raises(DataError) as error:
        request_params(record, {"n": 1}, "p.jsonl")
    assert hint in str(error.value)


def test_fields_that_look_like_settings_are_named_the_rest_are_the_users():
    records = [PromptRecord("x", fields={"answer": "4", "seed_id": 3, "maxLen": 9, "top_q": 1, "id": 7}),
               PromptRecord("y", fields={"stop_after": "x", "temperature": 0.5, "topic": "math", "template": "t",
                                         "temp_c": 1})]
    assert setting_like_fields(records) == ["maxLen", "seed_id", "stop_after", "temp_c", "top_q"]


def test_a_chat_prompt_for_a_tokenizer_without_a_template_names_its_line(model_dir, tmp_path):
    import shutil

    plain = tmp_path / "no_template"
    shutil.copytree(model_dir, plain)
    (plain / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((plain / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (plain / "tokenizer_config.json").write_text(json.dumps(config))
    rows = [{"prompt": "ab"}, {"prompt": [{"role": "user", "content": "hi"}]}]
    result = _run(["--model", str(plain), "--prompts", str(_prompts(tmp_path / "p.jsonl", rows)),
                   "--output", str(tmp_path / "o.jsonl")], tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "p.jsonl:2: " in result.stderr and "no chat template" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and not (tmp_path / "o.jsonl").exists()


def test_a_chat_prompt_its_template_refuses_names_its_line(model_dir, tmp_path):
    """Mistral's, Llama 2's and Gemma's templates raise for a misplaced system message: one line naming
    the prompts file's line, as training's data errors do, not a jinja traceback."""
    import shutil

    strict = tmp_path / "strict"
    shutil.copytree(model_dir, strict)
    (strict / "chat_template.jinja").write_text(
        "{% for m in messages %}{% if m['role'] == 'system' and not loop.first %}"
        "{{ raise_exception('System message must be first') }}{% endif %}"
        "{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}")
    rows = [{"prompt": "ab"}, {"prompt": [{"role": "user", "content": "hi"}, {"role": "system", "content": "x"},
                                          {"role": "user", "content": "and?"}]}]
    result = _run(["--model", str(strict), "--prompts", str(_prompts(tmp_path / "p.jsonl", rows)),
                   "--output", str(tmp_path / "o.jsonl")], tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "p.jsonl:2: the chat template refuses this conversation" in result.stderr
    assert "System message must be first" in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_an_empty_prompt_fails_alone_and_a_run_that_fails_every_request_exits_non_zero(model_dir, tmp_path):
    """An empty prompt is a request of its own: served from bos alone where the tokenizer has one (as
    transformers and vLLM do); a mapping of the user's own under a name other tools nest settings in
    is a field like any other. When every request fails, the exit is 2 and the lines are written
    beside --output (OUTPUT.partial), which keeps what it held (a run's earlier results)."""
    rows = [{"prompt": ""}, {"prompt": "ab", "options": {"A": "yes", "B": "no"}}]
    out = tmp_path / "o.jsonl"
    result = _run(["--model", str(model_dir), "--prompts", str(_prompts(tmp_path / "p.jsonl", rows)),
                   "--max-new-tokens", "3", "--output", str(out)], tmp_path)
    assert result.returncode == 0, result.stderr
    assert [json.loads(line)["finish_reason"] for line in out.read_text().splitlines()] == ["length", "length"]
    too_long = [{"prompt": "x" * 2000}, {"prompt": "y" * 2000}]  # past the model's context: each fails alone
    held = out.read_text()
    result = _run(["--model", str(model_dir), "--prompts", str(_prompts(tmp_path / "q.jsonl", too_long)),
                   "--output", str(out)], tmp_path)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert f"every request failed; --output {out} is left as it was, the errors are in {out}.partial; " \
           "the first: request 0: " in result.stderr
    assert out.read_text() == held  # the earlier results
    partial = Path(f"{out}.partial").read_text().splitlines()
    assert [json.loads(line)["finish_reason"] for line in partial] == ["error", "error"]
    capped = [{"prompt": "ab"}, {"prompt": "abcdefgh"}]  # bos + 2 and bos + 8 tokens, within a cap of 6
    result = _run(["--model", str(model_dir), "--prompts", str(_prompts(tmp_path / "r.jsonl", capped)),
                   "--max-model-len", "6", "--max-new-tokens", "10", "--output", str(out)], tmp_path)
    first, second = [json.loads(line) for line in out.read_text().splitlines()]
    assert result.returncode == 0 and (len(first["token_ids"]), first["finish_reason"]) == (3, "length")
    assert second["finish_reason"] == "error" and "max_model_len" in second["error"]


@pytest.mark.parametrize("output", ["p.jsonl", "MODEL/config.json"])
def test_output_that_is_an_input_is_refused(model_dir, tmp_path, output):
    """--output same as --prompts replaced the prompts with completions (exit 0); in the model's
    directory it replaced a checkpoint file."""
    prompts = _prompts(tmp_path / "p.jsonl", [{"prompt": "ab"}])
    target = str(model_dir / "config.json") if output.startswith("MODEL") else str(prompts)
    before = Path(target).read_text()
    result = _run(["--model", str(model_dir), "--prompts", str(prompts), "--output", target], tmp_path)
    what = "a file of --model" if output.startswith("MODEL") else "the --prompts file"
    assert result.returncode == 2 and f"--output {target}: is {what}" in result.stderr
    assert Path(target).read_text() == before
    if output.startswith("MODEL"):  # samples kept beside the checkpoint may be written again
        for _ in range(2):
            result = _run(["--model", str(model_dir), "--prompts", str(prompts), "--max-new-tokens", "2",
                           "--output", str(model_dir / "samples.jsonl")], tmp_path)
            assert result.returncode == 0, result.stderr
        (model_dir / "samples.jsonl").unlink()


def test_lines_without_a_seed_sample_with_their_own(model_dir, tmp_path):
    # The same prompt on three lines, no seed of their own: different samples (each line's seed is
    # derived from --seed and its position), the same again on a rerun; a line's own seed is kept.
    # A line seeded 1 does not replay line 0, whose seed is derived from --seed 0 (an affine
    # derivation once gave it exactly 1).
    rows = [{"prompt": "ab"}, {"prompt": "ab"}, {"prompt": "ab", "seed": 7}, {"prompt": "ab", "seed": 7},
            {"prompt": "ab", "seed": 1}]
    prompts = _prompts(tmp_path / "p.jsonl", rows)
    outputs = []
    for name in ("a.jsonl", "b.jsonl"):
        result = _run(["--model", str(model_dir), "--prompts", str(prompts), "--max-new-tokens", "16",
                       "--output", str(tmp_path / name)], tmp_path)
        assert result.returncode == 0, result.stderr
        outputs.append([json.loads(x)["token_ids"] for x in (tmp_path / name).read_text().splitlines()])
    first, second = outputs
    assert first == second
    assert first[0] != first[1]
    assert first[2] == first[3]
    assert first[4] not in (first[0], first[1])


def test_a_seeded_line_gives_the_same_bits_alone_or_among_other_lines(model_dir, tmp_path):
    # Batch invariance (engine.batch_invariant: auto, on here): tokens and log-probs bit for bit,
    # whatever else the file holds and however the engine batches and chunks it.
    line = {"prompt": "the quick brown fox", "seed": 3, "temperature": 1.0}
    others = [{"prompt": "12+34=" * 9, "seed": 1}, {"prompt": "ab", "max_new_tokens": 5}, {"prompt": "x" * 40}]
    outputs = []
    for name, rows in [("alone", [line]), ("among", [others[0], line, *others[1:]])]:
        result = _run(["--model", str(model_dir), "--prompts", str(_prompts(tmp_path / f"{name}.jsonl", rows)),
                       "--max-new-tokens", "24", "--output", str(tmp_path / f"{name}.out.jsonl")], tmp_path)
        assert result.returncode == 0, result.stderr
        outputs.append([json.loads(x) for x in (tmp_path / f"{name}.out.jsonl").read_text().splitlines()])
    alone, among = outputs[0][0], outputs[1][1]
    assert (alone["token_ids"], alone["logprobs"]) == (among["token_ids"], among["logprobs"])


def test_a_prompt_line_may_give_its_own_stop_strings(model_dir, tmp_path):
    def texts(rows: list[dict]) -> list[tuple[str, str]]:
        result = _run(["--model", str(model_dir), "--prompts", str(_prompts(tmp_path / "p.jsonl", rows)),
                       "--max-new-tokens", "12", "--output", str(tmp_path / "o.jsonl")], tmp_path)
        assert result.returncode == 0, result.stderr
        lines = [json.loads(x) for x in (tmp_path / "o.jsonl").read_text().splitlines()]
        return [(line["text"], line["finish_reason"]) for line in lines]

    [(free, reason)] = texts([{"prompt": "ab", "seed": 3}])
    stop = free[2]
    expected = (free[: free.index(stop) + 1], "stop")
    assert texts([{"prompt": "ab", "seed": 3, "stop": stop}, {"prompt": "ab", "seed": 3, "stop": ["#", stop]},
                  {"prompt": "ab", "seed": 3, "stop_strings": [stop]},
                  {"prompt": "ab", "seed": 3}]) == [expected, expected, expected, (free, reason)]


def test_a_null_field_is_a_setting_not_given(model_dir, tmp_path):
    """A table's row carries every column: a null override (a Parquet row without one) is no override."""
    rows = [{"prompt": "ab", "seed": 3}, {"prompt": "ab", "seed": 3, "max_new_tokens": None, "top_p": None,
                                         "stop": None, "stop_token_ids": None}]
    result = _run(["--model", str(model_dir), "--prompts", str(_prompts(tmp_path / "p.jsonl", rows)),
                   "--max-new-tokens", "6", "--output", str(tmp_path / "o.jsonl")], tmp_path)
    assert result.returncode == 0, result.stderr
    first, second = [json.loads(x) for x in (tmp_path / "o.jsonl").read_text().splitlines()]
    assert second["token_ids"] == first["token_ids"] and second["logprobs"] == first["logprobs"]


def test_stop_token_ids_from_a_line_and_the_command_line(model_dir, tmp_path):
    from tether.models.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(model_dir)

    def run(rows: list[dict], *extra: str) -> list[dict]:
        result = _run(["--model", str(model_dir), "--prompts", str(_prompts(tmp_path / "p.jsonl", rows)),
                       "--max-new-tokens", "12", "--output", str(tmp_path / "o.jsonl"), *extra], tmp_path)
        assert result.returncode == 0, result.stderr
        return [json.loads(x) for x in (tmp_path / "o.jsonl").read_text().splitlines()]

    [free] = run([{"prompt": "ab", "seed": 3}])
    third = free["token_ids"][2]
    assert third not in free["token_ids"][:2] and third != tokenizer.eos_token_id
    [by_line, by_flag, other] = run([{"prompt": "ab", "seed": 3, "stop_token_ids": [third]},
                                     {"prompt": "ab", "seed": 3, "stop_token_ids": []},
                                     {"prompt": "ab", "seed": 4, "max_new_tokens": 1}],
                                    "--stop-token-id", str(third))
    for line in (by_line, by_flag):  # the stop token is kept, as an EOS is
        assert (line["token_ids"], line["finish_reason"]) == (free["token_ids"][:3], "stop")
    assert other["finish_reason"] in ("length", "stop")
    # The checkpoint's generation_config.json names end-of-turn ids beside the tokenizer's eos (Llama
    # 3's <|eot_id|>): they stop a sample too, as in transformers' generate and vLLM.
    import shutil

    ended = tmp_path / "with_generation_config"
    shutil.copytree(model_dir, ended)
    (ended / "generation_config.json").write_text(json.dumps({"eos_token_id": [tokenizer.eos_token_id, third]}))
    prompts = _prompts(tmp_path / "p.jsonl", [{"prompt": "ab", "seed": 3}])
    result = _run(["--model", str(ended), "--prompts", str(prompts), "--max-new-tokens", "12",
                   "--output", str(tmp_path / "o.jsonl")], tmp_path)
    [line] = [json.loads(x) for x in (tmp_path / "o.jsonl").read_text().splitlines()]
    assert (line["token_ids"], line["finish_reason"]) == (free["token_ids"][:3], "stop")
    (ended / "generation_config.json").write_text('{"eos_token_id": "<|eot_id|>"}')
    result = _run(["--model", str(ended), "--prompts", str(prompts), "--output", str(tmp_path / "o.jsonl")], tmp_path)
    assert result.returncode == 2 and "generation_config.json: eos_token_id must be a token id" in result.stderr


@pytest.mark.parametrize(("extra", "needle"), [
    (["--output", "{tmp}"], "is a directory"),  # checked before generating, not after
    (["--n", "0"], "command line: "),
    (["--seed", "-5"], "command line: seed must be in [0, 2**64), got -5"),
    (["--max-model-len", "1"], "--max-model-len 1: must be in [2, "),
    (["--max-model-len", "99999999"], "(the model's context: max_position_embeddings"),
    (["--stop", ""], "--stop: a stop string must not be empty"),
    (["--device", "tpu"], "--device 'tpu': not a device (auto, cpu, cuda or cuda:N)"),
    (["--speculative", "ngram", "--draft-model", "{model}"], "--speculative ngram and --draft-model: give one"),
    (["--num-speculative-tokens", "0"], "--num-speculative-tokens must be >= 1, got 0"),
    (["--kv-cache-memory-fraction", "1.5"], "--kv-cache-memory-fraction must be in (0, 1], got 1.5"),
    (["--max-num-seqs", "0"], "--max-num-seqs must be >= 1, got 0"),
    (["--stop-token-id", "1000000"], "--stop-token-id 1000000: not in the model's vocabulary"),
    (["--output", "/dev/full"], "--output /dev/full: writing failed (No space left on device)"),
    pytest.param(["--device", "cuda"], "--device 'cuda': torch sees no CUDA device here",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")),
])
def test_bad_command_line_is_one_line_error(model_dir, tmp_path, extra, needle):
    prompts = _prompts(tmp_path / "p.jsonl", [{"prompt": "ok"}])
    extra = [arg.format(tmp=tmp_path, model=model_dir) for arg in extra]
    output = [] if "--output" in extra else ["--output", str(tmp_path / "o.jsonl")]
    result = _run(["--model", str(model_dir), "--prompts", str(prompts), *output, *extra], tmp_path)
    assert result.returncode == 2, result.stderr
    assert needle in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_output_to_dev_stdout_and_through_a_symlink(model_dir, tmp_path):
    """`--output /dev/stdout` streams the samples; a symlinked output file stays a symlink."""
    prompts = _prompts(tmp_path / "p.jsonl", [{"prompt": "ok"}])
    result = _run(["--model", str(model_dir), "--prompts", str(prompts), "--output", "/dev/stdout"], tmp_path)
    assert result.returncode == 0, result.stderr
    assert [json.loads(line)["prompt_index"] for line in result.stdout.splitlines()] == [0]  # JSON lines only
    assert "wrote 1 samples" in result.stderr
    target, link = tmp_path / "real.jsonl", tmp_path / "link.jsonl"
    target.write_text("old\n")
    link.symlink_to(target)
    result = _run(["--model", str(model_dir), "--prompts", str(prompts), "--output", str(link)], tmp_path)
    assert result.returncode == 0, result.stderr
    assert link.is_symlink() and json.loads(target.read_text().splitlines()[0])["prompt_index"] == 0
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.endswith(".partial")) == []
    dangling = tmp_path / "dangling.jsonl"
    dangling.symlink_to(tmp_path / "missing" / "out.jsonl")  # a link makes no directories
    result = _run(["--model", str(model_dir), "--prompts", str(prompts), "--output", str(dangling)], tmp_path)
    assert result.returncode == 2 and "target directory" in result.stderr and not (tmp_path / "missing").exists()


def test_device_cuda_loads_the_model_there(model_dir, tmp_path, monkeypatch):
    """`--device cuda` loads the model onto the GPU and the engine runs there. CI has none: the GPU is
    played by CPU tensors (``helpers.fake_cuda``), which record any op real CUDA would refuse."""
    from helpers.fake_cuda import FakeCuda
    from tether import generate
    from tether.cli import build_parser

    prompts = _prompts(tmp_path / "p.jsonl", [{"prompt": "12+34="}, {"prompt": "hello", "temperature": 0.8}])
    argv = ["generate", "--model", str(model_dir), "--prompts", str(prompts), "--max-new-tokens", "8",
            "--temperature", "0"]
    on_cpu = generate.run_generate(build_parser().parse_args([*argv, "--output", str(tmp_path / "cpu.jsonl"),
                                                              "--device", "cpu"]))
    fake, load_model, devices = FakeCuda(), generate.load_model, []

    def load_onto(path, dtype, device):
        devices.append(device)
        model = load_model(path, dtype=dtype)  # the CPU's tensors, marked as on the device below
        return fake.put(model) if device.type == "cuda" else model

    monkeypatch.setattr(generate, "load_model", load_onto)
    with fake:
        on_gpu = generate.run_generate(build_parser().parse_args([*argv, "--output", str(tmp_path / "gpu.jsonl")]))
    assert devices == [torch.device("cuda", 0)]  # --device auto picks the GPU torch sees
    assert fake.errors == {}, "\n".join(fake.errors)
    cpu_lines, gpu_lines = ([json.loads(x) for x in p.read_text().splitlines()] for p in (on_cpu, on_gpu))
    assert cpu_lines[0]["token_ids"] == gpu_lines[0]["token_ids"]  # greedy: the same tokens
    assert gpu_lines[0]["logprobs"] == pytest.approx(cpu_lines[0]["logprobs"], abs=1e-4)
    assert gpu_lines[1]["finish_reason"] in ("length", "stop")


@on_gpu
def test_generate_on_a_real_gpu_matches_the_cpu(model_dir, tmp_path):
    from tether import generate
    from tether.cli import build_parser

    prompts = _prompts(tmp_path / "p.jsonl", [{"prompt": "12+34="}, {"prompt": "hello", "temperature": 0.8}])
    argv = ["generate", "--model", str(model_dir), "--prompts", str(prompts), "--max-new-tokens", "8",
            "--temperature", "0"]
    outputs = [generate.run_generate(build_parser().parse_args([*argv, "--output", str(tmp_path / f"{d}.jsonl"),
                                                                 "--device", d])) for d in ("cpu", "cuda")]
    cpu_lines, gpu_lines = ([json.loads(x) for x in p.read_text().splitlines()] for p in outputs)
    assert cpu_lines[0]["token_ids"] == gpu_lines[0]["token_ids"]  # greedy: the same tokens
    assert gpu_lines[0]["logprobs"] == pytest.approx(cpu_lines[0]["logprobs"], abs=1e-4)
    assert gpu_lines[1]["finish_reason"] in ("length", "stop")


def test_device_names():
    from helpers.fake_cuda import FakeCuda
    from tether.builders import resolve_device
    from tether.errors import ConfigError

    assert resolve_device("cpu") == torch.device("cpu")
    with FakeCuda():  # one GPU, played by the CPU
        assert resolve_device("auto") == resolve_device("cuda") == resolve_device("cuda:0") == torch.device("cuda", 0)
        with pytest.raises(ConfigError, match=r"^--device 'cuda:1': torch sees 1 CUDA device\(s\), cuda:0 to cuda:0$"):
            resolve_device("cuda:1", "--device")
    with pytest.raises(ConfigError, match="'mps': not a device"):
        resolve_device("mps")

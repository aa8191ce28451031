import pathlib
import sys

# Test helpers (tiny checkpoints built with transformers itself) live in tests/helpers/.
sys.path.insert(0, str(pathlib.Path(__file__).parent))

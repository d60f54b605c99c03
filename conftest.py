import os

# The tests compare services' greedy outputs with transformers' generate in float32; on a CPU with
# AMX the verifier's dtype auto would serve the bfloat16 target. The bfloat16 path has tests of its
# own (common/test_invariant_bf16.py, services/router/test_core_bf16.py).
os.environ.setdefault("COSINE_DTYPE", "float32")

pytest_plugins = ["common.testing"]

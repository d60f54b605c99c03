"""The ``--kv-cache`` flag as the verifier, the drafters and ``cosine up`` take it (one text, one
set of choices; ``common.runtime.kv_arena.select_kv_cache`` resolves it)."""

KV_CACHES = ("auto", "paged", "contiguous")
KV_CACHE_HELP = (
    "KV cache: paged (every request's keys/values in blocks of one arena, a block table each; one batched write "
    "and one attention call a layer), contiguous (a growable cache per request, with the attention backend's own "
    "kernels); auto picks paged on CUDA and contiguous on a CPU, where the CPU kernel on per-request caches is "
    "faster"
)

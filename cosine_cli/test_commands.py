"""The CLI's profile command writes real profiles into a real Redis."""

import asyncio
import json

from common.platform.store import Store
from cosine_cli.cluster import split_drafters, thread_budget
from cosine_cli.main import main


def profiles(url, prefix, ids):
    async def body():
        store = Store.from_url(url, prefix=prefix)
        try:
            return await store.load_profiles(ids)
        finally:
            await store.close()

    return asyncio.run(body())


def test_profile_from_zoo_and_by_measuring(tiny_zoo, redis_url, redis_prefix, tmp_path, capsys):
    assert main(["profile", "--zoo", str(tiny_zoo.root), "--redis-url", redis_url, "--redis-prefix", redis_prefix]) == 0
    got = profiles(redis_url, redis_prefix, list(tiny_zoo.drafters))
    for d, row in tiny_zoo.acceptance.items():
        for domain, value in row.items():
            assert got[d].domains[domain].prior == value

    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        "\n".join(json.dumps({"domain": d, "text": t}) for d in tiny_zoo.domains for t in tiny_zoo.prompts[d][:2])
    )
    prefix = redis_prefix + "-m"
    drafter = next(iter(tiny_zoo.drafters.values()))
    rc = main(
        [
            "profile",
            "--measure",
            "--target",
            str(tiny_zoo.target.path),
            "--drafter",
            f"x={drafter.path}",
            "--prompts",
            str(prompts),
            "--redis-url",
            redis_url,
            "--redis-prefix",
            prefix,
            "--new-tokens",
            "8",
        ]
    )
    assert rc == 0
    measured = profiles(redis_url, prefix, ["x"])["x"]
    assert set(measured.domains) == set(tiny_zoo.domains)
    assert all(0 <= s.prior <= 4 for s in measured.domains.values())


def test_profile_seeds_a_lookup_corpus_of_the_user_s_text(tiny_zoo, redis_url, redis_prefix, tmp_path, capsys):
    from common.runtime.checkpoints import load_tokenizer

    texts = tmp_path / "outputs.jsonl"
    texts.write_text(
        json.dumps({"domain": "code", "text": "def f(x):\n    return x"})
        + "\n"
        + json.dumps({"domain": "code", "text": "import os"})
        + "\n"
    )
    assert (
        main(
            [
                "profile",
                "--zoo",
                str(tiny_zoo.root),
                "--corpus",
                str(texts),
                "--redis-url",
                redis_url,
                "--redis-prefix",
                redis_prefix,
            ]
        )
        == 0
    )
    assert "lookup corpus of 2 sequences" in capsys.readouterr().out

    async def load():
        store = Store.from_url(redis_url, prefix=redis_prefix)
        try:
            return await store.load_corpus()
        finally:
            await store.close()

    tok = load_tokenizer(tiny_zoo.tokenizer_path)
    assert asyncio.run(load()) == {"code": [tok("def f(x):\n    return x").input_ids, tok("import os").input_ids]}


def test_thread_budget_gives_the_verifier_every_core_and_the_drafters_half():
    for cores in (1, 2, 4, 16):
        for procs in (1, 2, 3):
            v, d = thread_budget(cores, procs)
            assert v == cores and d >= 1
            assert d * procs <= max(cores // 2, procs)
    assert thread_budget(2, 1) == (2, 1)
    assert thread_budget(16, 2) == (16, 4)


def test_drafters_are_spread_over_processes():
    groups = split_drafters({"a": "1", "b": "2", "c": "3"}, 2)
    assert groups == [{"a": "1", "c": "3"}, {"b": "2"}]
    assert split_drafters({"a": "1"}, 4) == [{"a": "1"}]

"""Admission control (queue, refusal, cancellation hand-over) and bearer-token checks."""

from __future__ import annotations

import asyncio

import pytest

from specula.runtime.config import AuthConfig, ConfigError, load_config
from specula.runtime.serve.admission import Admission, Overloaded
from specula.runtime.serve.auth import authorized, bearer_token


def test_admission_queues_then_refuses_and_hands_over_in_order():
    async def main():
        adm = Admission(max_concurrent=1, max_queued=1)
        order: list[str] = []
        gate = asyncio.Event()

        async def job(name: str):
            async with adm.slot():
                order.append(name)
                await gate.wait()

        a = asyncio.create_task(job("a"))
        await asyncio.sleep(0)
        b = asyncio.create_task(job("b"))
        await asyncio.sleep(0)
        assert adm.running == 1 and adm.queued == 1
        with pytest.raises(Overloaded, match="max_queued_requests=1"):
            async with adm.slot():
                pass
        gate.set()
        await asyncio.gather(a, b)
        assert order == ["a", "b"]
        assert adm.running == 0 and adm.queued == 0

    asyncio.run(main())


def test_admission_cancelled_waiter_frees_its_place():
    async def main():
        adm = Admission(max_concurrent=1, max_queued=2)
        gate = asyncio.Event()
        done: list[str] = []

        async def job(name: str):
            async with adm.slot():
                await gate.wait()
                done.append(name)

        a = asyncio.create_task(job("a"))
        await asyncio.sleep(0)
        b = asyncio.create_task(job("b"))
        c = asyncio.create_task(job("c"))
        await asyncio.sleep(0)
        b.cancel()
        await asyncio.sleep(0)
        assert adm.queued == 1
        gate.set()
        await asyncio.gather(a, c)
        with pytest.raises(asyncio.CancelledError):
            await b
        assert done == ["a", "c"] and adm.running == 0

    asyncio.run(main())


def test_bearer_checks():
    keys = frozenset({"s3cret", "other"})
    assert authorized(None, frozenset())  # auth off
    assert authorized("Bearer s3cret", keys) and authorized("bearer other", keys)
    for bad in (None, "", "Bearer", "Bearer wrong", "Basic s3cret", "s3cret", "Bearer s3cre"):
        assert not authorized(bad, keys), bad
    assert bearer_token("Bearer  tok ") == "tok"


def test_auth_keys_from_env(monkeypatch):
    monkeypatch.setenv("SPECULA_TEST_KEYS", "a, b,,")
    cfg = AuthConfig(api_keys=["c"], api_keys_env="SPECULA_TEST_KEYS")
    assert cfg.keys() == {"a", "b", "c"}
    assert AuthConfig().keys() == frozenset()


def test_grpc_tls_needs_both_files():
    with pytest.raises(ConfigError, match="tls_cert_file and tls_key_file"):
        load_config({"grpc": {"tls_cert_file": "x.pem"}})
    with pytest.raises(ConfigError, match="limits.max_queued_requests"):
        load_config({"limits": {"max_queued_requests": -1}})

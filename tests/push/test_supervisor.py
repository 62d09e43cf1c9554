"""Which queues the push supervisor looks at: the registry keeps the queues whose config has push, so
that its walk every half second does not visit tens of thousands of queues without (it sorted and
looked up every queue's name, ~56 ms a walk at 35,000 queues, held up every request)."""

from __future__ import annotations

from pathlib import Path

from broker.config import Settings
from broker.server import open_broker

PUSH = {"push": {"url": "http://127.0.0.1:9/hook"}}


async def test_the_queues_with_push_are_kept_as_configs_change(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path)
    async with open_broker(settings) as broker, broker.app.test_app() as app:
        client = app.test_client()
        for name, config in [("plain", {}), ("hooked", PUSH), ("later", {}), ("dropped", PUSH)]:
            assert (await client.put(f"/v1/queues/{name}", json=config)).status_code == 201
        await client.put("/v1/queues/later", json=PUSH)
        await client.put("/v1/queues/dropped", json={"push": None})
        assert set(broker.registry.pushing()) == {"hooked", "later"}

        await client.delete("/v1/queues/hooked")
        await client.put("/v1/queues/hooked", json={})  # made again, without push
        assert set(broker.registry.pushing()) == {"later"}
        assert broker.registry.pushing()["later"] is broker.registry.get("later")

    async with open_broker(settings) as broker:  # recovered from the journal
        assert set(broker.registry.pushing()) == {"later"}
        assert broker.push is not None
        broker.push.reconcile()
        assert broker.push.status("later") is not None and broker.push.status("plain") is None

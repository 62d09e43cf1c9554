from tests.conftest import Client, make_queue


async def test_publish_claim_ack_round_trip(client: Client) -> None:
    await make_queue(client)
    published = await client.post("/v1/queues/jobs/messages", json={"payload": {"n": 1}})
    assert published.status_code == 201
    claimed = await (await client.post("/v1/queues/jobs/claim", json={"consumer": "w"})).get_json()
    assert [m["payload"] for m in claimed["messages"]] == [{"n": 1}]
    acked = await client.post("/v1/queues/jobs/ack", json={"leases": [claimed["messages"][0]["lease_id"]]})
    assert (await acked.get_json()) == {"acked": 1, "skipped": []}

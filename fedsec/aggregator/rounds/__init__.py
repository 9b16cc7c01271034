"""The round engine: one concern per module, joined by the facade
:class:`fedsec.aggregator.coordinator.Coordinator`.

- :mod:`.attempt` — the attempt in progress and the checks a message for it passes;
- :mod:`.lifecycle` — the stage table: deadlines, what completes and closes each stage;
- :mod:`.context` — what every part shares (workspace, clock, log, change token);
- :mod:`.cohort` — joins, staleness, fixing the cohort, the signed spec;
- :mod:`.intake` — accepting stage messages: idempotency, storage, receipts;
- :mod:`.reports` — members' signed privacy reports;
- :mod:`.refusals` — the bounded log of refused masked inputs;
- :mod:`.apply` — aggregate → new model version;
- :mod:`.resume` — rebuilding the attempt in progress from the state store.
"""

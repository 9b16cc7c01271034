"""fedsec aggregator."""

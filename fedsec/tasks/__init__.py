"""fedsec tasks."""

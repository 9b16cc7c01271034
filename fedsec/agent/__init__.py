"""fedsec agent."""

"""fedsec audit."""

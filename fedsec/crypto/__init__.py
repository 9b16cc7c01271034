"""fedsec crypto."""

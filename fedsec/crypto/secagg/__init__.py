"""fedsec crypto.secagg."""

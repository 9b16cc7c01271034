"""A tabular regression fedsec task whose records live in a member's PostgreSQL table."""

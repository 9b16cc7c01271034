"""``python -m fedsec`` runs the CLI (used to start agents and aggregators as processes)."""

from fedsec.cli import main

main()

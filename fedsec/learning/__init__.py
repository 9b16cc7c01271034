"""Learning: local training (DP-SGD) and the server optimisers.

Pure functions of their inputs, shared by the agent (which trains), the aggregator
(which applies the mean update) and the auditor (which re-derives both), so the
three can never disagree on the arithmetic: the auditor's re-derived model is bit
for bit the aggregator's because it is computed by the same code.
"""

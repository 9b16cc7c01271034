"""Learning: local training (DP-SGD), the server optimisers and the robust aggregation
rules of trusted mode (with FLTrust's reference training).

Pure functions of their inputs, shared by the agent (which trains), the aggregator
(which applies the mean update) and the auditor (which re-derives both), so the
three can never disagree on the arithmetic: the auditor's re-derived model is bit
for bit the aggregator's because it is computed by the same code.
"""

"""fedsec: federated learning with DP-SGD, SecAgg+ secure summation and a verifiable audit trail."""

__version__ = "0.1.0"

"""An image-folder fedsec task: scikit-learn's digits as 32x32 RGB PNG files."""

"""The S3 dataset: key layout, the store (conditional writes), the Parquet records, reading prompt files.

The bottom layer: imports nothing from the package but other dataset modules.
Everything above it may import it.
"""

"""What every bench shares: timing (`timing`), the one result schema and file naming (`results`), the
synthetic model configs (`models`) and the sync helpers of the services benches (`syncs`).

Import the submodule you need; none of them imports torch at import time."""

"""Models autopart ships: ``nanogpt`` (the demo GPT), ``zoo`` (Hugging Face causal LMs from
small random configs, and the compatibility matrix) and ``data/`` (the demo corpus)."""

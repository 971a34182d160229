"""The foundation, torch-free and used by every tier: the configuration schema and its composing, the engine
spec, FLOP and parameter counts, the run directory, the Hugging Face format's names and shapes."""

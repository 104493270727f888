"""Example-only code, apart from the core: the model-bridge smoke run (`megarl smoke`) and the GGUF -> HF converter
behind the SmolLM2 example (`megarl convert-gguf`)."""

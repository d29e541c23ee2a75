"""Engine-agnostic parts the vLLM and SGLang adapters share: the store data path and its copy kernels."""

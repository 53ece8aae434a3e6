"""The tiny testbed's tokenizer: a fixed vocabulary derived from the corpus generator's alphabets.

Capitalised words (template and grammar words, colours) are single tokens, every other character
is one token, there are no spaces and the decoder inserts none, so ``decode(encode(x)) == x``.
No BOS, EOS ``<eos>``, pad ``<pad>``, left padding (for batched generation). The tokenizer itself
has no unknown token and fails on an unknown symbol; ``rpb.pipeline.data.split_symbols`` names it.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

from rpb.pipeline.data import EOS_TOKEN, PAD_TOKEN, TOKEN_PATTERN, vocabulary

# User text then assistant text then EOS, nothing in between: chat-formatted SFT sees exactly the
# prompt+completion sequences the plain trainer builds. The generation tags let
# apply_chat_template(return_assistant_tokens_mask=True) mark answer-only loss.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'user' -%}{{ message['content'] }}"
    "{%- elif message['role'] == 'assistant' -%}"
    "{% generation %}{{ message['content'] }}{{ eos_token }}{% endgeneration %}"
    "{%- else -%}{{ raise_exception('unsupported chat role: ' + message['role']) }}"
    "{%- endif -%}"
    "{%- endfor -%}"
)


def build_tokenizer(out_dir: Path | None = None) -> PreTrainedTokenizerFast:
    """Build the tokenizer; with ``out_dir`` also save it (loadable by AutoTokenizer offline)."""
    vocab = {token: i for i, token in enumerate(vocabulary())}
    backend = Tokenizer(models.WordLevel(vocab))  # no unk token: unknown symbols are errors
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(TOKEN_PATTERN), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        padding_side="left",
        clean_up_tokenization_spaces=False,
        chat_template=CHAT_TEMPLATE,
    )
    # Registering specials must not have grown the vocabulary (ids are fixed by vocabulary()).
    if len(tokenizer) != len(vocab):
        raise RuntimeError(f"tokenizer has {len(tokenizer)} tokens, vocabulary {len(vocab)}")
    if out_dir is not None:
        tokenizer.save_pretrained(str(out_dir))
    return tokenizer


def encode(tokenizer: PreTrainedTokenizerBase, text: str, where: str) -> list[int]:
    """Token ids of `text` (no special tokens); an untokenizable text raises naming `where`
    (e.g. "corpus.jsonl:12"), since the fast tokenizer's own error names neither."""
    try:
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    except Exception as err:  # tokenizers raises its own exception types
        raise ValueError(f"{where}: cannot tokenize {text[:60]!r} ({err})") from None

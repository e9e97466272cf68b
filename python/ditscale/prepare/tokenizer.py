"""An offline byte-level tokenizer for random-weight UMT5 text encoders (no download).

Token ids: 0 ``<pad>``, 1 ``</s>`` (appended to every text, as UMT5's tokenizer does), 2
``<unk>``, then one id per byte (3..258) of the UTF-8 text, through the ``tokenizers`` library's
byte-level pre-tokenizer and a BPE model without merges. It gives the random encoder
deterministic, caption-dependent inputs; a real text encoder comes with its own tokenizer
(``--text-encoder DIR``). See [docs/prepare.md](../../../docs/prepare.md#encoders).
"""

from __future__ import annotations

SPECIAL = ("<pad>", "</s>", "<unk>")
VOCAB_SIZE = len(SPECIAL) + 256


def byte_tokenizer():
    """A transformers PreTrainedTokenizerFast over the byte-level vocabulary above."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL)}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>",
                                                       special_tokens=[("</s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>",
                                   unk_token="<unk>")

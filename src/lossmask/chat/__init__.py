"""Chats to token ids: render with the tokenizer's own template, tokenise, and mark message text.

What leaves this stage is ids plus a data mask (True where a token is message text), so that
message text is data, never structure, in the engine.

- ``tokenizer``: ``ChatTokenizer``, the one adapter over Hugging Face tokenizers and processors;
- ``render``: the direct renderer (the compiled template, fed from Arrow rows), and
  ``ChatTemplateError``, what rendering raises (``ChatTokenizer.render`` is the other renderer);
- ``locate``: where each message's text landed in the rendered text;
- ``specials``: which special-token strings in message text stay tokens, and encoding the rest as text;
- ``fast_tokens``: the exact fast tokeniser, proven against ``tokenizers`` per job;
- ``encode_rendered``: rendered rows to ids and the data mask;
- ``encode_batch``: a batch of chat (or prompt/completion) rows to ids and the data mask: render,
  then ``encode_rendered``;
- ``probes``: the probe conversations that show what a template writes;
- ``media``: a processor's images (and Qwen2-VL's videos): what its template writes for one, its expansion, which
  tokens are media;
- ``encode_media``: chat rows through a processor, each image expanded as the processor expands it;
- ``turn_spans``: each assistant turn found from the rendering alone (``FromRendering``: labels for templates whose
  token markers cannot be read).
"""

from .encode_batch import EncodedBatch, encode_table, render_table, tokenize_rendered
from .probes import Conversation, probe_conversations, renderable_probes
from .tokenizer import ChatTemplateError, ChatTokenizer, load_tokenizer
from .turn_spans import FromRendering

__all__ = [
    "ChatTemplateError", "ChatTokenizer", "Conversation", "EncodedBatch", "FromRendering", "encode_table", "load_tokenizer",
    "probe_conversations", "render_table", "renderable_probes", "tokenize_rendered",
]

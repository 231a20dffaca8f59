"""``MaskOptions``: how a masking job labels its rows, one value passed from the entry point down.

``mask_files``, ``hf.mask_dataset``, ``hf.train_on_responses_only`` and ``ray.mask_dataset`` each take
``options=MaskOptions(...)`` and, for convenience, the same fields as keywords
(``mask_files(..., max_length=2048)``); ``MaskOptions.resolve`` turns either into one checked value,
so the list of fields lives here alone and a misspelt keyword names the ones that exist.

Every stage reads this one value, so this module imports nothing else of lossmask.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

SPECIAL_TOKENS_IN_CONTENT = ("text", "keep", "drop", "error")
CONSECUTIVE_ROLES = ("merge", "keep")
LEADING_ASSISTANT = ("drop", "keep")
EMPTY_MESSAGES = ("drop", "keep")
CHECK_ROLES = ("unusual", "all")
TRUNCATION = ("end", "history")
TRAIN_ON_EOS = ("turn", "last", "all", "none")
REASONING = ("train", "mask")
# a message's own weight, read from these fields (OpenAI ``weight``, axolotl ``train``/``training``, ms-swift
# ``loss``/``loss_scale``, LLaMA-Factory ``loss_weight``): a false in any switches it off, else the first number weighs
# it, else a true gives 1; ``weight_field`` names one instead
WEIGHT_FIELDS = ("weight", "train", "training", "loss", "loss_scale", "loss_weight")
# the largest weight: float32's largest finite value (loss_weights are float32); a weight above it is refused, never
# written as inf
MAX_WEIGHT = 3.4028234663852886e38
DETAIL_FIELD = "train_detail"  # axolotl's character spans: [{begin_offset, end_offset (inclusive), train[, weight]}]
# ShareGPT's speaker names (``from``) and the roles they become; ``role_map`` adds to this or overrides it
SHAREGPT_ROLES = {
    "human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant",
    "bard": "assistant", "assistant": "assistant", "system": "system", "function_call": "assistant",
    "observation": "tool", "tool": "tool",
}
# the roles chat templates write (and the roles ``role_map`` maps speakers to): a role option naming another warns
KNOWN_ROLES = ("system", "user", "assistant", "tool", "developer", "ipython", "function")
# message keys that hold something other than a weight: ``weight_field`` naming one warns
NOT_WEIGHTS = ("role", "content", "name", "tool_calls", "tool_call_id", "reasoning_content", "reasoning", "thinking",
               "from", "value", "type", "text", "id", "function", "tools", "images", "image", "url")
SHAREGPT_COLUMN = "conversations"  # read as the chat when the messages column is left at its default and absent
# Alpaca rows (docs/inputs.md, "Alpaca"): each part of a row and the column that holds it; ``alpaca_columns`` adds to
# this or overrides it (LLaMA-Factory's dataset_info.json names them prompt, query, response, system and history)
ALPACA_COLUMNS = {"instruction": "instruction", "input": "input", "output": "output", "system": "system",
                  "history": "history"}

DEFAULT_BATCH_SIZE = 16_384
# the most input bytes (Arrow) of one batch a file job renders and labels at once: a batch of long chats is cut into
# pieces of about this size, so that a job's memory is bounded by bytes, whatever the rows' length (docs/benchmarks.md)
DEFAULT_BATCH_BYTES = 8 << 20
DEFAULT_MAX_DROP_FRACTION = 0.30  # the safety net's default: a job stops when more of its rows train nothing
LABEL_DTYPES = ("int64", "int32")
# images (docs/vision.md): the most pixels one image may hold, read from its header before it is decoded, and the
# most image tokens a processor may make for one row's images; a row over either is invalid, named
DEFAULT_MAX_IMAGE_PIXELS = 50_000_000
DEFAULT_MAX_MEDIA_TOKENS = 65_536
# the most wall seconds labelling one row from its rendering may take (chat/turn_spans.py: templates whose markers
# cannot be read, and rows whose marker labels break the role invariant); a row past it is dropped, counted as
# rendering_over_budget. One render inside it is bounded apart (chat/render.py, MAX_RENDER_SECONDS)
DEFAULT_ROW_RENDERING_SECONDS = 30.0


@dataclass(frozen=True)
class MaskOptions:
    """How rows are read, labelled, kept and checked; every field has the default a job uses."""

    # which columns hold the input, and what the output columns are called
    input_ids_column: str = "input_ids"
    messages_column: str = "messages"
    prompt_column: str = "prompt"
    completion_column: str = "completion"
    # the trained mask: int64/int32 labels under labels_column (None: no labels column, for a compact output of
    # input_ids + the int8 completion_mask, which TRL's SFTTrainer reads with completion_only_loss=True)
    labels_column: str | None = "labels"
    completion_mask_column: str | None = None  # write TRL's 0/1 completion_mask under this name
    loss_weights_column: str = "loss_weights"  # float32 per token, written when weights can be fractional or asked for
    # the input columns written beside the token columns: None all of them (passthrough), a list just those, () none.
    # The token columns (input_ids, labels, completion_mask, loss_weights) are written whatever it says
    keep_columns: Any = None
    # how rows are tokenised and labelled
    max_length: int | None = None
    # how a chat row longer than max_length is cut: "end" (its tail) or "history" (its earliest exchanges, whole,
    # until it fits, as LLaMA-Factory's mask_history does; the last exchange is cut at the end only when alone too long)
    truncation: str = "end"
    last_turn_only: bool = False
    # conversational prompt/completion rows: the completion trains, as TRL's completion_only_loss does; True also trains
    # the assistant turns inside the prompt (docs/inputs.md, "Prompt/completion rows")
    train_prompt_turns: bool = False
    ignore_index: int = -100
    label_dtype: str = "int64"
    backend: str | None = None
    # special-token strings in message text: "text" (encode as ordinary text), "keep" (as control
    # tokens), "drop" (the row, counted as special_tokens_in_content) or "error"
    special_tokens_in_content: str = "text"
    # conversation shapes, normalised before rendering (chat/shapes.py; docs/inputs.md, "Conversation shapes"):
    # messages of one role in a row joined with a blank line, or kept apart; messages before the first user
    # message (other than system) dropped or kept; messages with no text dropped or kept
    consecutive_roles: str = "merge"
    leading_assistant: str = "drop"
    empty_messages: str = "drop"
    drop_system_message: bool = False  # system messages removed before rendering (axolotl's and LLaMA-Factory's meaning)
    # ShareGPT ``{from, value}`` messages: speaker -> role, over SHAREGPT_ROLES (a dict, or "human=user,gpt=assistant")
    role_map: Any = None
    # chat rows: the column holding each row's system prompt (LLaMA-Factory's columns.system), put first as a system
    # message unless the chat opens with one; an empty or null value adds none
    system_column: str | None = None
    # Alpaca rows: part -> column (None: not read), over ALPACA_COLUMNS (a dict, or "instruction=question,output=answer")
    alpaca_columns: Any = None
    # weights (docs/weights.md): a float per token; labels train where it is > 0. Sources, applied in this order:
    # per role (roles_to_train: the roles that train, weight 1; weights_by_role: role -> weight, over it), the
    # message's own field (weight_field: "auto" reads WEIGHT_FIELDS, a name reads that one, None none), character
    # spans (detail_field) and content parts with train/weight, the reasoning policy ("train", "mask" or a weight;
    # mask_empty_think), the stop-token policy (train_on_eos), then prompt_weight for every token nothing claimed.
    # Only prompt_weight, train_on_eos and last_turn_only apply to pre-tokenised input_ids.
    roles_to_train: Any = None
    weights_by_role: Any = None
    weight_field: str | None = "auto"
    detail_field: str | None = DETAIL_FIELD
    prompt_weight: float = 0.0
    train_on_eos: str = "turn"
    reasoning: Any = "train"
    mask_empty_think: bool = False
    loss_weights: bool = False  # write the loss_weights column even when every weight is 0 or 1
    source_column: str | None = None  # the report counts trained tokens and weight mass per value of this column
    # which rows have the role invariant checked with character offsets: "unusual" (every row whose shape the
    # marker probes did not cover) or "all" (every row; slower: tokenising with offsets)
    check_roles: str = "unusual"
    # what happens to rows that train nothing
    keep_dropped: bool = False
    max_drop_fraction: float = DEFAULT_MAX_DROP_FRACTION
    # how much is read at a time: at most batch_size rows, and (files) at most about batch_bytes of them
    batch_size: int = DEFAULT_BATCH_SIZE
    batch_bytes: int = DEFAULT_BATCH_BYTES
    # chats with images, through a processor (docs/vision.md): the folder a relative image path is read from (default:
    # the folder of the data file that holds the row; the current folder for in-memory datasets), options given to
    # every call of the processor (a dict, or "do_pan_and_scan=true,max_pixels=1000000"), and the bounds above
    media_dir: str | None = None
    processor_kwargs: Any = None
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    max_media_tokens: int = DEFAULT_MAX_MEDIA_TOKENS
    # the most seconds labelling one row from its rendering may take: the row is then dropped, counted and named
    max_row_rendering_seconds: float = DEFAULT_ROW_RENDERING_SECONDS

    def __post_init__(self) -> None:
        if self.max_length is not None and not _positive_int(self.max_length):
            raise ValueError(f"max_length={self.max_length!r} must be a positive integer (or None for no truncation)")
        if not _positive_int(self.batch_size):
            raise ValueError(f"batch_size={self.batch_size!r} must be a positive number of rows (e.g. {DEFAULT_BATCH_SIZE})")
        if not _positive_int(self.batch_bytes):
            raise ValueError(f"batch_bytes={self.batch_bytes!r} must be a positive number of bytes (e.g. {DEFAULT_BATCH_BYTES})")
        if isinstance(self.max_drop_fraction, bool) or not isinstance(self.max_drop_fraction, (int, float)) \
                or not 0.0 <= self.max_drop_fraction <= 1.0:
            raise ValueError(f"max_drop_fraction={self.max_drop_fraction!r} must be a fraction in [0, 1] (e.g. 0.30)")
        if isinstance(self.max_row_rendering_seconds, bool) or not isinstance(self.max_row_rendering_seconds, (int, float)) \
                or not self.max_row_rendering_seconds > 0:
            raise ValueError(f"max_row_rendering_seconds={self.max_row_rendering_seconds!r} must be a positive number of "
                             f"seconds (e.g. {DEFAULT_ROW_RENDERING_SECONDS:g})")
        for name in ("max_image_pixels", "max_media_tokens"):
            if not _positive_int(getattr(self, name)):
                raise ValueError(f"{name}={getattr(self, name)!r} must be a positive integer")
        if self.media_dir is not None:
            import os

            object.__setattr__(self, "media_dir", os.fspath(self.media_dir))
        object.__setattr__(self, "processor_kwargs", parse_processor_kwargs(self.processor_kwargs))
        if self.label_dtype not in LABEL_DTYPES:
            raise ValueError(f"label_dtype={self.label_dtype!r}; pass one of {LABEL_DTYPES}")
        if self.special_tokens_in_content not in SPECIAL_TOKENS_IN_CONTENT:
            raise ValueError(
                f"special_tokens_in_content={self.special_tokens_in_content!r}; pass one of {SPECIAL_TOKENS_IN_CONTENT} "
                "('text', the default, encodes special-token strings in message text as ordinary text)"
            )
        for name, value, allowed in (("consecutive_roles", self.consecutive_roles, CONSECUTIVE_ROLES),
                                     ("leading_assistant", self.leading_assistant, LEADING_ASSISTANT),
                                     ("empty_messages", self.empty_messages, EMPTY_MESSAGES),
                                     ("check_roles", self.check_roles, CHECK_ROLES),
                                     ("truncation", self.truncation, TRUNCATION)):
            if value not in allowed:
                raise ValueError(f"{name}={value!r}; pass one of {allowed}")
        if self.train_on_eos not in TRAIN_ON_EOS:
            raise ValueError(f"train_on_eos={self.train_on_eos!r}; pass one of {TRAIN_ON_EOS} ('turn', the default, trains "
                             "each assistant turn's stop token)")
        object.__setattr__(self, "prompt_weight", _weight("prompt_weight", self.prompt_weight))
        if not (isinstance(self.reasoning, str) and self.reasoning in REASONING):
            if isinstance(self.reasoning, str):
                try:
                    value = float(self.reasoning)
                except ValueError:
                    raise ValueError(f"reasoning={self.reasoning!r}; pass 'train', 'mask' or a weight >= 0 such as 0.5") from None
            else:
                value = self.reasoning
            object.__setattr__(self, "reasoning", _weight("reasoning", value))
        object.__setattr__(self, "weights_by_role", parse_role_weights(self.roles_to_train, self.weights_by_role))
        object.__setattr__(self, "roles_to_train", None if self.roles_to_train is None else
                           tuple(parse_roles(self.roles_to_train)))
        if self.weight_field is not None and (not isinstance(self.weight_field, str) or not self.weight_field):
            raise TypeError(f"weight_field={self.weight_field!r}: pass 'auto' (reads {WEIGHT_FIELDS}), a field name, or None")
        # a hashable, checked form: a tuple of (speaker, role) pairs, the user's over the defaults
        object.__setattr__(self, "role_map", parse_role_map(self.role_map))
        object.__setattr__(self, "alpaca_columns", parse_alpaca_columns(self.alpaca_columns))
        if self.system_column is not None and (not isinstance(self.system_column, str) or not self.system_column):
            raise TypeError(f"system_column={self.system_column!r}: pass the name of the column that holds the system "
                            "prompt, or None")
        _warn_unlikely_weights(self)
        if self.labels_column is not None and (not isinstance(self.labels_column, str) or not self.labels_column):
            raise TypeError(f"labels_column={self.labels_column!r}: pass a column name, or None to write only "
                            "completion_mask (with completion_mask=True)")
        if self.labels_column is None and not self.completion_mask_column:
            raise ValueError("labels_column=None writes no labels, so the output must carry the trained mask as "
                             "completion_mask: pass completion_mask=True too (--labels-column none --completion-mask)")
        object.__setattr__(self, "keep_columns", parse_keep_columns(self.keep_columns))
        names = [n for n in (self.labels_column, self.completion_mask_column) if n]
        if len(set(names)) != len(names):
            raise ValueError(f"labels_column and completion_mask_column must differ, both are {self.labels_column!r}")
        if self.loss_weights_column in names:
            raise ValueError(f"loss_weights_column={self.loss_weights_column!r} must differ from the labels and "
                             "completion_mask columns")

    def role_weights(self) -> dict[str, float]:
        """role -> weight of that role's messages (assistant 1.0 unless a role option says otherwise)."""
        return dict(self.weights_by_role)

    def message_weights(self) -> bool:
        """Does any message-level source apply (roles, the reasoning policy, the empty-think rule)? Fields in the data
        (weight_field, detail_field) are read whenever a row carries them."""
        return (self.weights_by_role != (("assistant", 1.0),) or self.reasoning != "train" or self.mask_empty_think)

    def token_weights(self) -> bool:
        """Does a marker-level weight choice differ from the default (these apply to every input, ids included)?"""
        return self.prompt_weight != 0.0 or self.train_on_eos != "turn"

    def fractional(self) -> bool:
        """Can the options alone give a weight other than 0 and 1 (then loss_weights is always written)?"""
        values = [self.prompt_weight, *dict(self.weights_by_role).values()]
        if not isinstance(self.reasoning, str):
            values.append(self.reasoning)
        return any(v not in (0.0, 1.0) for v in values)

    def writes_loss_weights(self, field_types: Any = ()) -> bool:
        """Is a loss_weights column written: when asked for, when the options can give fractional weights, or when
        the messages carry a weight field that is not a boolean (``field_types``: the Arrow types of the message
        fields read as weights)."""
        import pyarrow as pa

        return self.loss_weights or self.fractional() or any(not pa.types.is_boolean(t) for t in field_types)

    def weight_fields(self) -> tuple[str, ...]:
        """The message fields read as its weight."""
        if self.weight_field is None:
            return ()
        return WEIGHT_FIELDS if self.weight_field == "auto" else (self.weight_field,)

    def processor_call_kwargs(self) -> dict[str, Any]:
        """The keywords given to every processor call (``processor_kwargs``)."""
        return dict(self.processor_kwargs)

    def roles(self) -> dict[str, str]:
        """The ShareGPT speaker -> role map this job uses."""
        return dict(self.role_map)

    def alpaca(self) -> dict[str, str]:
        """The Alpaca part -> column map this job uses (instruction, input, output, system, history)."""
        return dict(self.alpaca_columns)

    def chat_column(self, names: Any) -> str:
        """The column that holds the chat: ``messages_column``, or ShareGPT's ``conversations`` when the messages
        column is left at its default and the input has none."""
        names = set(names)
        if self.messages_column not in names and self.messages_column == "messages" and SHAREGPT_COLUMN in names:
            return SHAREGPT_COLUMN
        return self.messages_column

    @classmethod
    def resolve(cls, options: "MaskOptions | None" = None, /, **fields: Any) -> "MaskOptions":
        """``options`` with ``fields`` replaced (or the defaults with them); ``completion_mask=True`` or a
        column name stands for ``completion_mask_column``. Unknown names raise ``TypeError`` listing the known."""
        if options is not None and not isinstance(options, cls):
            raise TypeError(f"options={options!r}: pass a lossmask.MaskOptions (or its fields as keywords)")
        if "completion_mask" in fields:
            fields["completion_mask_column"] = completion_mask_column(fields.pop("completion_mask"))
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(fields) - known)
        if unknown:
            raise TypeError(f"unknown masking option(s) {unknown}; MaskOptions has {sorted(known | {'completion_mask'})}")
        if options is None:
            return cls(**fields)
        return dataclasses.replace(options, **fields) if fields else options


def completion_mask_column(completion_mask: str | bool | None) -> str | None:
    """``True`` -> ``"completion_mask"``, ``False``/``None`` -> no column, a string -> that column name."""
    if completion_mask is True:
        return "completion_mask"
    if completion_mask in (None, False):
        return None
    if isinstance(completion_mask, str) and completion_mask:
        return completion_mask
    raise TypeError(f"completion_mask={completion_mask!r}: pass True, False or a column name")


def parse_keep_columns(columns: Any) -> tuple[str, ...] | None:
    """``keep_columns`` (None, a list of names, or the CLI's ``"a,b"``; ``""`` and ``[]`` keep none) as a tuple."""
    if columns is None:
        return None
    if isinstance(columns, str):
        columns = [c.strip() for c in columns.split(",") if c.strip()]
    if not isinstance(columns, (list, tuple)) or not all(isinstance(c, str) and c for c in columns):
        raise TypeError(f"keep_columns={columns!r}: pass a list of input column names such as ['id', 'source'], "
                        "[] for none, or None for all")
    return tuple(dict.fromkeys(columns))  # in the order given, each once


def parse_role_map(role_map: Any) -> tuple[tuple[str, str], ...]:
    """``role_map`` (None, a dict, pairs, or ``"human=user,gpt=assistant"``) over ``SHAREGPT_ROLES``, as sorted pairs."""
    given = _mapping("role_map", role_map, "SPEAKER=ROLE", "human=user,gpt=assistant", "{'human': 'user'}")
    if not all(isinstance(k, str) and isinstance(v, str) and k and v for k, v in given.items()):
        raise ValueError(f"role_map={role_map!r}: speakers and roles must be non-empty strings")
    return tuple(sorted({**SHAREGPT_ROLES, **given}.items()))


def parse_alpaca_columns(columns: Any) -> tuple[tuple[str, str], ...]:
    """``alpaca_columns`` (None, a dict, pairs, or ``"instruction=question,output=answer"``) over ``ALPACA_COLUMNS``, as
    pairs in the order of ``ALPACA_COLUMNS``."""
    given = _mapping("alpaca_columns", columns, "PART=COLUMN", "instruction=question,output=answer", "{'output': 'answer'}")
    unknown = sorted(set(given) - set(ALPACA_COLUMNS))
    if unknown:
        raise ValueError(f"alpaca_columns={columns!r} names {unknown}; the parts of an Alpaca row are "
                         f"{', '.join(ALPACA_COLUMNS)}")
    if not all(v is None or (isinstance(v, str) and v) for v in given.values()):
        raise ValueError(f"alpaca_columns={columns!r}: column names must be non-empty strings (None: the part is not read)")
    merged = {**ALPACA_COLUMNS, **given}
    return tuple((part, merged[part]) for part in ALPACA_COLUMNS)


def _mapping(name: str, value: Any, form: str, example: str, shown: str) -> dict:
    """A mapping option given as None, a dict, pairs, or the CLI's ``"k=v,k=v"`` (``form``, ``example``), as a dict."""
    if isinstance(value, tuple) and all(isinstance(p, tuple) and len(p) == 2 for p in value):
        return dict(value)
    if value is None:
        return {}
    if isinstance(value, str):
        return _pairs(name, value, form, example)
    if isinstance(value, dict):
        return dict(value)
    raise TypeError(f"{name}={value!r}: pass a dict such as {shown} or {example!r}")


def _pairs(name: str, text: str, form: str, example: str, convert: Any = str) -> dict:
    """``"k=v,k=v"`` (the CLI's form of a mapping) as a dict, each value through ``convert``."""
    given = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = (part.strip() for part in item.partition("="))
        try:
            given[key] = convert(value)
        except ValueError:
            sep = ""
        if not sep or not key or not value:
            raise ValueError(f"{name}={text!r}: {item!r} is not {form}; write it as {example!r}") from None
    return given


def parse_processor_kwargs(kwargs: Any) -> tuple[tuple[str, Any], ...]:
    """``processor_kwargs`` (None, a dict, pairs, or ``"do_pan_and_scan=true,max_pixels=1000000"``, each value read as
    JSON where it parses, else kept as a string) as sorted pairs."""
    import json

    if kwargs is None:
        return ()
    if isinstance(kwargs, tuple) and all(isinstance(p, tuple) and len(p) == 2 for p in kwargs):
        given = dict(kwargs)
    elif isinstance(kwargs, str):
        def value(text: str) -> Any:
            try:
                return json.loads(text)
            except ValueError:
                return text

        given = _pairs("processor_kwargs", kwargs, "KEY=VALUE", "do_pan_and_scan=true", value)
    elif isinstance(kwargs, dict):
        given = dict(kwargs)
    else:
        raise TypeError(f"processor_kwargs={kwargs!r}: pass a dict such as {{'do_pan_and_scan': True}} or "
                        "'do_pan_and_scan=true'")
    if not all(isinstance(k, str) and k.isidentifier() for k in given):
        raise ValueError(f"processor_kwargs={kwargs!r}: keys must be the processor's keyword names")
    return tuple(sorted(given.items()))


def parse_roles(roles: Any) -> list[str]:
    """``roles_to_train``: a list of role names, or ``"assistant,user"``."""
    if isinstance(roles, str):
        roles = [r.strip() for r in roles.split(",") if r.strip()]
    if not isinstance(roles, (list, tuple)) or not all(isinstance(r, str) and r for r in roles):
        raise TypeError(f"roles_to_train={roles!r}: pass a list of roles such as ['assistant', 'user'] or 'assistant,user'")
    return list(roles)


def parse_role_weights(roles_to_train: Any, weights_by_role: Any) -> tuple[tuple[str, float], ...]:
    """role -> weight, as sorted pairs: ``roles_to_train`` gives its roles weight 1 and every other role 0 (assistant
    too, when it is left out); ``weights_by_role`` (a dict, pairs, or ``"assistant=1,user=0.1"``) then sets its own."""
    table = {"assistant": 1.0}
    if roles_to_train is not None:
        table = {role: 1.0 for role in parse_roles(roles_to_train)}
        table.setdefault("assistant", 0.0)
    if weights_by_role is None:
        given = {}
    elif isinstance(weights_by_role, str):
        given = _pairs("weights_by_role", weights_by_role, "ROLE=WEIGHT", "assistant=1,user=0.1", float)
    elif isinstance(weights_by_role, dict):
        given = dict(weights_by_role)
    elif isinstance(weights_by_role, tuple):
        given = dict(weights_by_role)
    else:
        raise TypeError(f"weights_by_role={weights_by_role!r}: pass a dict such as {{'assistant': 1.0, 'user': 0.1}} "
                        "or 'assistant=1,user=0.1'")
    for role, value in given.items():
        if not isinstance(role, str) or not role:
            raise ValueError(f"weights_by_role={weights_by_role!r}: roles must be non-empty strings")
        table[role] = _weight(f"weights_by_role[{role!r}]", value)
    return tuple(sorted(table.items()))


def _weight(name: str, value: Any) -> float:
    """A weight: a number from 0 to ``MAX_WEIGHT`` (float32's largest), booleans 1 and 0; -0.0 is 0."""
    if isinstance(value, bool):
        return float(value)
    if not isinstance(value, (int, float)) or not 0 <= value <= MAX_WEIGHT:  # NaN and inf fail the comparison
        beyond = isinstance(value, (int, float)) and value > MAX_WEIGHT
        raise ValueError(f"{name}={value!r} must be a finite weight >= 0 (0 masks, 1 trains fully, 0.1 trains lightly)"
                         + (f"; float32 holds none above {MAX_WEIGHT:.8g}" if beyond else ""))
    return float(value) + 0.0


def _warn_unlikely_weights(options: MaskOptions) -> None:
    """One warning line for a role option naming a role no template writes (``wizard``), and for a ``weight_field``
    that names a field holding something else (``content``): both are accepted, and probably not what was meant."""
    import warnings

    roles = set(KNOWN_ROLES) | {role for _, role in options.role_map}
    unknown = sorted(set(dict(options.weights_by_role)) - roles)
    if unknown:
        warnings.warn(f"weights_by_role/roles_to_train name {', '.join(map(repr, unknown))}, which no chat template "
                      f"writes as a role (known: {', '.join(sorted(roles))}): check the spelling, or map the data's "
                      "speakers to a known role with role_map (--role-map SPEAKER=ROLE)", UserWarning, stacklevel=4)
    if options.weight_field in NOT_WEIGHTS or options.weight_field == options.detail_field:
        warnings.warn(f"weight_field={options.weight_field!r} names a message field that holds no weight, so it never "
                      f"gives one; pass weight_field='auto' (reads {', '.join(WEIGHT_FIELDS)}) or the name of the field "
                      "that holds each message's weight (--weight-field NAME)", UserWarning, stacklevel=4)


def _positive_int(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and value >= 1

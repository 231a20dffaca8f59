"""The ``lossmask`` command line. Only this module touches argparse; each command calls the API."""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from contextlib import contextmanager


def _example(args: argparse.Namespace) -> int:
    from .example import run_example

    return run_example()


def _add_image_arguments(parser: argparse.ArgumentParser) -> None:
    from .options import DEFAULT_MAX_IMAGE_PIXELS, DEFAULT_MAX_MEDIA_TOKENS

    images = parser.add_argument_group("chats with images, through a processor (docs/vision.md)")
    images.add_argument("--media-dir", metavar="DIR",
                        help="the folder a relative image path is read from (default: the folder of the data file "
                             "that holds the row); absolute paths are read as they are")
    images.add_argument("--processor-kwargs", metavar="KEY=VALUE,...",
                        help="options given to every call of the processor, values read as JSON where they parse "
                             "(do_pan_and_scan=true,max_pixels=1003520)")
    images.add_argument("--max-image-pixels", type=int, default=DEFAULT_MAX_IMAGE_PIXELS, metavar="N",
                        help="the most pixels one image may hold, read from its header "
                             f"(default {DEFAULT_MAX_IMAGE_PIXELS:,}); a row with a larger image is invalid, named")
    images.add_argument("--max-media-tokens", type=int, default=DEFAULT_MAX_MEDIA_TOKENS, metavar="N",
                        help="the most image tokens the processor may make for one row "
                             f"(default {DEFAULT_MAX_MEDIA_TOKENS:,}); a row over it is invalid, named")


def _image_options(args: argparse.Namespace) -> dict:
    return dict(media_dir=args.media_dir, processor_kwargs=args.processor_kwargs,
                max_image_pixels=args.max_image_pixels, max_media_tokens=args.max_media_tokens)


def _mask(args: argparse.Namespace) -> int:
    from .jobs.stopping import stop_on_signals

    with _fail_cleanly_on_signals(), _warnings_on_one_line(), stop_on_signals():
        # SIGTERM, Ctrl-C and SIGHUP end the job between kernel calls, with one line
        return _mask_job(args)


def _mask_job(args: argparse.Namespace) -> int:
    from .jobs.stopping import JobStopped

    if args.show_tokens < 0:  # checked before the job, which --show follows
        print(f"lossmask mask: error: --show-tokens {args.show_tokens}: give a number of tokens, 0 or more (0 prints "
              "whole rows)", file=sys.stderr)
        return 1
    try:
        from .options import MaskOptions
        from .jobs.stream import mask_files, preview_rows

        options = MaskOptions.resolve(
            input_ids_column=args.input_ids_column, messages_column=args.messages_column,
            prompt_column=args.prompt_column, completion_column=args.completion_column,
            labels_column=None if args.labels_column == "none" else args.labels_column,
            completion_mask=args.completion_mask, keep_columns=_keep_columns(args), max_length=args.max_length,
            truncation=args.truncation,
            keep_dropped=args.keep_dropped, max_drop_fraction=args.max_drop_fraction,
            last_turn_only=args.last_turn_only, train_prompt_turns=args.train_prompt_turns,
            batch_size=args.batch_size, batch_bytes=args.batch_bytes, label_dtype=args.label_dtype,
            special_tokens_in_content=args.special_tokens_in_content, **_shape_options(args),
            alpaca_columns=args.alpaca_columns,
            check_roles=args.check_roles, roles_to_train=args.roles_to_train, weights_by_role=args.weights_by_role,
            weight_field=None if args.weight_field == "none" else args.weight_field,
            detail_field=None if args.detail_field == "none" else args.detail_field,
            prompt_weight=args.prompt_weight, train_on_eos=args.train_on_eos, reasoning=args.reasoning,
            mask_empty_think=args.mask_empty_think, loss_weights=args.loss_weights,
            loss_weights_column=args.loss_weights_column, source_column=args.source_column,
            max_row_rendering_seconds=args.max_row_rendering_seconds, **_image_options(args),
        )
        tokenizer = _tokenizer_to_show(args)
        report = mask_files(
            args.input, args.output, tokenizer=tokenizer if tokenizer is not None else args.tokenizer,
            chat_template=args.chat_template,
            model_name=args.model_name, markers=args.markers, strict=args.strict, input_format=args.input_format,
            options=options, compression=args.compression, num_proc=args.num_proc,
            progress=False if args.no_progress else None, report=args.report,
            dataset_info=args.dataset_info, dataset=args.dataset,
        )
    except (ValueError, TypeError, OSError, ImportError) as exc:  # OSError: one line naming the path and the cause
        print(f"lossmask mask: error: {_error_text(exc)}", file=sys.stderr)
        return 1
    except JobStopped as stop:  # mask_files removed its partial files (and its lock) on the way out
        _say(f"lossmask mask: stopped by {stop.name}; the partial output was removed, and {_escaped(args.output)} is as "
             "it was before the job")
        return 128 + stop.signum
    try:
        print(report.summary())
        if args.show:
            colour = sys.stdout.isatty()
            legend = "trained tokens highlighted" if colour else "trained tokens in [brackets]"
            rows = "first row" if args.show == 1 else f"first {args.show} rows"
            print(f"\n{rows} of {args.output}, a line per message ({legend}):")
            print(preview_rows(args.output, tokenizer, rows=args.show, input_ids_column=args.input_ids_column,
                               labels_column=options.labels_column,
                               completion_mask_column=options.completion_mask_column, colour=colour, markers=report.markers,
                               max_tokens=args.show_tokens))
    except JobStopped as stop:
        _say(f"lossmask mask: stopped by {stop.name} after {_escaped(args.output)} was written")
        return 128 + stop.signum
    return 0


def _keep_columns(args: argparse.Namespace) -> str | tuple | None:
    """``--drop-input-columns`` keeps none of the input's columns; ``--keep-columns A,B`` keeps those; neither, all."""
    if args.drop_input_columns:
        if args.keep_columns is not None:
            raise ValueError("--drop-input-columns and --keep-columns both say which input columns to write; pass one")
        return ()
    return args.keep_columns


def _tokenizer_to_show(args: argparse.Namespace):
    """With ``--show``, the job's tokenizer loaded once, here, for the job and then the preview (a second load
    cost a large vocabulary's tokenizer.json again, ~0.5 CPU-s); None without ``--show``, or when it does not
    load, so that ``mask_files`` loads the path and words any error as it always does."""
    if not args.show or not args.tokenizer:
        return None
    from .jobs.stream import load_chat_tokenizer

    try:
        return load_chat_tokenizer(args.tokenizer, chat_template=args.chat_template)
    except Exception:  # noqa: BLE001 - the job meets the same error and reports it in its own words
        return None


def _say(line: str) -> None:
    """One line on stderr, where a closed terminal (SIGHUP) may no longer take it: the exit status says it then."""
    try:
        print(line, file=sys.stderr)
    except OSError:
        pass


_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def format_warning(message, category, filename, lineno, line=None) -> str:
    """A warning of lossmask's as ``lossmask mask`` prints it: one line, ``lossmask mask: warning: ...``."""
    return f"lossmask mask: warning: {_bounded(message)}\n"


@contextmanager
def _warnings_on_one_line():
    """While the job runs, each warning lossmask gives is one line on stderr (``format_warning``), as its errors are;
    other libraries' warnings keep the format they had, and that format is put back when the job ends."""
    before = warnings.formatwarning

    def formatted(message, category, filename, lineno, line=None):
        if os.path.abspath(filename).startswith(_PACKAGE):
            return format_warning(message, category, filename, lineno, line)
        return before(message, category, filename, lineno, line)

    warnings.formatwarning = formatted
    try:
        yield
    finally:
        warnings.formatwarning = before


def _escaped(text: str) -> str:
    from .jobs.display import escaped

    return escaped(str(text))


def _bounded(text: str) -> str:
    """A line of an error or a warning, escaped, and cut at ``MAX_ERROR_LINE`` characters: a message quoting a value
    whole (a 200,000-character name) still prints as one line of bounded length."""
    from .jobs.display import MAX_ERROR_LINE, one_line

    return one_line(text, MAX_ERROR_LINE)


def _error_text(exc: BaseException) -> str:
    """An error as the command line prints it: one line, a file name with a newline in it escaped as ``repr`` does.
    The messages written as several lines (too many dropped rows, markers that cannot be resolved) keep their line
    ends; the names in them are escaped where they are written (``InputFiles.where``)."""
    from .jobs.safety import TooManyDroppedRows
    from .markers.policy import MarkerResolutionError

    lines = str(exc).split("\n") if isinstance(exc, (TooManyDroppedRows, MarkerResolutionError)) else [str(exc)]
    return "\n".join(map(_bounded, lines))


@contextmanager
def _fail_cleanly_on_signals():
    """While the job runs, a write beyond the file size limit fails with an error (EFBIG) instead of SIGXFSZ killing
    the process with its partial files in place; the handler before is put back after. (SIGTERM and SIGINT:
    ``jobs.stopping.stop_on_signals``.)"""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "SIGXFSZ"):
        yield
        return
    before = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGXFSZ, before)


def _add_shape_arguments(parser: argparse.ArgumentParser, title: str):
    """The conversation-shape options, the same for ``mask`` and ``show`` (which reads a chat as the job would)."""
    shapes = parser.add_argument_group(title)
    shapes.add_argument("--consecutive-roles", choices=("merge", "keep"), default="merge",
                        help="two or more user (or assistant, or system) messages in a row: join them with a blank "
                             "line (default) or keep them apart")
    shapes.add_argument("--leading-assistant", choices=("drop", "keep"), default="drop",
                        help="messages before the first user message, other than system (a chat that opens with an "
                             "assistant message): drop them (default, as FastChat and LLaMA-Factory do) or keep them")
    shapes.add_argument("--empty-messages", choices=("drop", "keep"), default="drop",
                        help="user, assistant or system messages with no text: drop them (default) or keep them. A row "
                             "left with no user message followed by an assistant message is dropped as no_exchange")
    shapes.add_argument("--drop-system-message", action="store_true",
                        help="remove every system message before rendering (as axolotl's and LLaMA-Factory's option); "
                             "a template's default system prompt is still written")
    shapes.add_argument("--role-map", metavar="FROM=ROLE,...",
                        help="ShareGPT input (a 'conversations' column of {from, value}): speaker names to roles, over "
                             "the default human=user, gpt/chatgpt/bing/bard=assistant, system=system, "
                             "function_call=assistant, observation/tool=tool")
    return shapes


def _shape_options(args: argparse.Namespace) -> dict:
    return dict(consecutive_roles=args.consecutive_roles, leading_assistant=args.leading_assistant,
                empty_messages=args.empty_messages, drop_system_message=args.drop_system_message,
                role_map=args.role_map)


def _add_mask_command(commands) -> None:
    from .jobs.display import SHOW_TOKENS

    mask = commands.add_parser(
        "mask", help="label a dataset file by file, batch by batch, and write Parquet with labels",
        description="Label INPUT (Parquet file, folder or glob; Arrow IPC; JSONL) and write OUTPUT (Parquet), "
        "dropping rows that train nothing (counted per reason). Markers come from --markers or from --tokenizer.",
    )
    mask.add_argument("input", metavar="INPUT", nargs="?", help="Parquet file, folder or glob of them; Arrow IPC; JSONL or "
                      "a JSON array, also gzip/zstd/bzip2 compressed; - for stdin (docs/inputs.md). Rows hold "
                      "input_ids (token ids), messages (a chat), prompt + completion, or Alpaca's instruction + "
                      "output. Left out with --dataset-info")
    mask.add_argument("output", metavar="OUTPUT", help="the Parquet file to write (its folder must exist; a name such as "
                      "out.jsonl is refused): the input columns plus labels (and input_ids when tokenised here); "
                      "written only when the job succeeds, while a lock keeps other jobs off it")
    source = mask.add_argument_group("markers (one of)")
    source.add_argument("--tokenizer", metavar="DIR", help="tokenizer folder: markers from its chat template; "
                        "also renders and tokenises messages / prompt+completion rows")
    source.add_argument("--markers", metavar="FILE.json", help='markers as token ids, for data tokenised elsewhere: '
                        '{"response": [[ids...], ...], "instruction": [[ids...]], "end": [[ids...]], "mask_out": []} '
                        '(lists of id patterns; only "response" is required; `lossmask detect TOKENIZER --json` prints them)')
    mask.add_argument("--model-name", metavar="NAME", help="model name, for the template table when detection fails")
    mask.add_argument("--chat-template", metavar="FILE", help="a Jinja chat template replacing the tokenizer's own")
    mask.add_argument("--strict", action="store_true", help="fail instead of training full sequences when no markers are found")
    mask.add_argument("--input-format", choices=("parquet", "ipc", "json"), help="default: from the file suffix, else its first bytes")
    mask.add_argument("--dataset-info", metavar="FILE", help="LLaMA-Factory's dataset_info.json: read the dataset "
                      "--dataset names there (its file_name, formatting, columns and tags) instead of INPUT")
    mask.add_argument("--dataset", metavar="NAME", help="the dataset of --dataset-info to read")
    mask.add_argument("--input-ids-column", default="input_ids", metavar="NAME")
    mask.add_argument("--messages-column", default="messages", metavar="NAME")
    mask.add_argument("--prompt-column", default="prompt", metavar="NAME")
    mask.add_argument("--completion-column", default="completion", metavar="NAME")
    output = mask.add_argument_group(
        "the output's columns (docs/inputs.md, \"The output's columns\"): input_ids and the trained mask, beside "
        "the input's own columns")
    output.add_argument("--labels-column", default="labels", metavar="NAME",
                        help="where the labels go (default labels); none writes no labels, with --completion-mask "
                             "the int8 mask alone (TRL's SFTTrainer reads input_ids + completion_mask with "
                             "SFTConfig(completion_only_loss=True))")
    output.add_argument("--completion-mask", nargs="?", const=True, default=None, metavar="NAME",
                        help="also write TRL's 0/1 completion_mask, int8 (under NAME, default completion_mask)")
    output.add_argument("--keep-columns", metavar="NAME,...",
                        help="write only these input columns beside the token columns (default: every input column, "
                             "e.g. messages, as it is); an empty string keeps none")
    output.add_argument("--drop-input-columns", action="store_true",
                        help="write none of the input's columns: only input_ids, labels / completion_mask and "
                             "loss_weights (smaller files, faster writes)")
    mask.add_argument("--max-length", type=int, metavar="N", help="truncate tokenised rows to N tokens")
    mask.add_argument("--truncation", choices=("end", "history"), default="end",
                      help="how a chat row over --max-length is cut: its tail (default), or its earliest exchanges, "
                           "whole, until it fits (LLaMA-Factory's mask_history; the system prompt stays)")
    mask.add_argument("--special-tokens-in-content", choices=("text", "keep", "drop", "error"), default="text",
                      help="special-token strings inside message text: encode as ordinary text (default), keep as "
                           "control tokens, drop the row, or stop with an error naming it")
    shapes = _add_shape_arguments(mask, "conversation shapes (docs/inputs.md; every change is counted in the report)")
    shapes.add_argument("--alpaca-columns", metavar="PART=COLUMN,...",
                        help="Alpaca input (instruction, input, output, optional system and history; read as a chat): "
                             "the columns of its parts, over the default instruction=instruction, input=input, "
                             "output=output, system=system, history=history")
    shapes.add_argument("--check-roles", choices=("unusual", "all"), default="unusual",
                        help="rows checked for user, system or tool text that trains and assistant text that does not "
                             "(labelled from their rendering, else dropped as template_breaks_roles): every row of "
                             "an unusual shape (default), or all rows (slower)")
    _add_image_arguments(mask)
    weights = mask.add_argument_group(
        "weights (docs/weights.md): a float per token, labels train where it is > 0; sources apply in this order: "
        "role, the message's field, character spans and content parts, reasoning, stop tokens, prompt weight. "
        "Ids given as input_ids take --prompt-weight, --train-on-eos and --last-turn-only only")
    weights.add_argument("--roles-to-train", metavar="ROLE,...",
                         help="the roles whose messages train, weight 1 (default assistant); a role left out, assistant "
                              "included, does not train. Other roles train their message text only")
    weights.add_argument("--weights-by-role", metavar="ROLE=W,...",
                         help="a weight per role, over --roles-to-train, e.g. assistant=1,user=0.1")
    weights.add_argument("--weight-field", default="auto", metavar="NAME",
                         help="the message field read as its weight (true/false or a number): auto (default) reads "
                              "weight, train, training, loss, loss_scale, loss_weight (a false switches the message "
                              "off, the first number weighs it); none reads none")
    weights.add_argument("--detail-field", default="train_detail", metavar="NAME",
                         help="character spans in a message, [{begin_offset, end_offset (inclusive), train or weight}], "
                              "as axolotl writes them: only the spans train (default train_detail; none reads none). "
                              "Content parts carrying train or weight are read too")
    weights.add_argument("--prompt-weight", type=float, default=0.0, metavar="W",
                         help="the weight of every other token (prompts, headers, other roles), e.g. 0.05; default 0")
    weights.add_argument("--train-on-eos", choices=("turn", "last", "all", "none"), default="turn",
                         help="stop tokens, as axolotl's train_on_eos: each trained assistant turn's (default), the row's "
                              "last turn's only, every one, after other roles' and untrained turns too (all), or none")
    weights.add_argument("--reasoning", default="train", metavar="train|mask|W",
                         help="an assistant turn's reasoning (think block, gpt-oss analysis channel) and the template's "
                              "text up to its answer: train (default), mask, or a weight such as 0.5")
    weights.add_argument("--mask-empty-think", action="store_true",
                         help="mask an empty <think></think> block before an answer (ms-swift's ignore_empty_think)")
    weights.add_argument("--loss-weights", action="store_true",
                         help="always write the loss_weights column (float32 per token); it is written anyway when a "
                              "weight can be other than 0 and 1")
    weights.add_argument("--loss-weights-column", default="loss_weights", metavar="NAME")
    weights.add_argument("--source-column", metavar="NAME",
                         help="report trained tokens and weight mass per value of this column (a mixture's dataset name)")
    mask.add_argument("--keep-dropped", action="store_true", help="keep rows that train nothing (still counted)")
    mask.add_argument("--max-drop-fraction", type=float, default=0.30, metavar="F",
                      help="abort, writing nothing, when more than F of the rows train nothing (default %(default)s)")
    mask.add_argument("--last-turn-only", action="store_true", help="train only the last assistant turn of each row")
    from .options import DEFAULT_ROW_RENDERING_SECONDS

    mask.add_argument("--max-row-rendering-seconds", type=float, default=DEFAULT_ROW_RENDERING_SECONDS, metavar="S",
                      help="labelling one row from its rendering (templates whose markers cannot be read, rows the "
                           "markers break) stops after S seconds: the row is dropped as rendering_over_budget, counted "
                           "and named (default %(default)g)")
    mask.add_argument("--train-prompt-turns", action="store_true",
                      help="conversational prompt/completion rows: train the assistant turns inside the prompt too "
                           "(default: only the completion trains, as TRL's completion_only_loss does)")
    mask.add_argument("--batch-size", type=int, default=16_384, metavar="ROWS", help="rows per batch (bounds memory; default %(default)s)")
    mask.add_argument("--batch-bytes", type=int, default=8 << 20, metavar="BYTES",
                      help="at most about this many input bytes per batch: long rows make smaller batches, so memory "
                           "is bounded whatever the rows' length (default %(default)s, 8 MiB)")
    output.add_argument("--label-dtype", choices=("int64", "int32"), default="int64",
                        help="labels as int64 (the Hugging Face convention) or int32 (smaller files, faster writes)")
    mask.add_argument("--compression", default="snappy", metavar="CODEC",
                      help="Parquet compression of OUTPUT: snappy (default), zstd, lz4, gzip, brotli or none")
    mask.add_argument("--num-proc", type=int, default=1, metavar="N",
                      help="label messages / prompt+completion rows in up to N worker processes, each carrying the "
                           "whole step of a batch (render, tokenise, label, encode); at most one per core, from "
                           "4,000 rows")
    mask.add_argument("--report", metavar="FILE.json", help="write the report as JSON")
    mask.add_argument("--no-progress", action="store_true", help="no progress bar, even on a terminal")
    mask.add_argument("--show", type=int, default=0, metavar="N",
                      help="print the first N output rows, a line per message, trained tokens marked")
    mask.add_argument("--show-tokens", type=int, default=SHOW_TOKENS, metavar="N",
                      help="--show prints about N tokens of a row (default %(default)s): past that, each message's "
                           "head and tail, with the count of what was left out; 0 prints whole rows")
    mask.set_defaults(run=_mask)


def _show(args: argparse.Namespace) -> int:
    from .jobs.stream import check_tokenizer_path
    from .show import run_show

    try:
        check_tokenizer_path(args.tokenizer)
        from .options import MaskOptions

        options = MaskOptions(**_shape_options(args))
        return run_show(args.tokenizer, args.conversation, html_path=args.html, model_name=args.model_name,
                        row=args.row, options=options)
    except (ValueError, TypeError, OSError, ImportError) as exc:
        print(f"lossmask show: error: {_error_text(exc)}", file=sys.stderr)
        return 1


def _detect(args: argparse.Namespace) -> int:
    from .jobs.stream import check_tokenizer_path
    from .show import run_detect

    try:
        check_tokenizer_path(args.tokenizer)
        return run_detect(args.tokenizer, model_name=args.model_name, as_json=args.json)
    except (ValueError, TypeError, FileNotFoundError, ImportError) as exc:
        print(f"lossmask detect: error: {_error_text(exc)}", file=sys.stderr)
        return 1


def _add_show_commands(commands) -> None:
    show = commands.add_parser(
        "show", help="render a conversation and show which tokens train (terminal or HTML page)",
        description="Render a chat (CHAT: one chat as JSON, or a row of a data file; default: a built-in sample with a "
        "system prompt, several turns and a tool call) with the tokenizer's chat template, as `lossmask mask` would, "
        "choose markers as training would (detection, then the template table), and show the trained tokens.",
    )
    show.add_argument("tokenizer", metavar="TOKENIZER", help="tokenizer folder (tokenizer.json + tokenizer_config.json)")
    show.add_argument("conversation", metavar="CHAT", nargs="?",
                      help="a JSON file with one chat ({\"messages\": [...], \"tools\": [...]}, ShareGPT's "
                           "{\"conversations\": [{\"from\", \"value\"}, ...]}, prompt + completion, or a bare list "
                           "of messages), or any input `lossmask mask` reads (JSON Lines, a JSON array, Parquet, Arrow "
                           "IPC, compressed; token ids too); default: the built-in sample")
    show.add_argument("--row", type=int, default=0, metavar="N", help="the row of CHAT to show (from 0; default 0)")
    _add_shape_arguments(show, "conversation shapes, as lossmask mask applies them (docs/inputs.md)")
    show.add_argument("--html", metavar="OUT.html", help="write a self-contained HTML page instead of printing")
    show.add_argument("--model-name", metavar="NAME", help="model name, for the template table when detection fails")
    show.set_defaults(run=_show)
    detect = commands.add_parser(
        "detect", help="print the markers of a tokenizer, where they came from, and their verification",
        description="Choose markers as training would (detection from the chat template, then the template table) "
        "and print them as ids and text, their source and the verification against the ground truth, with the kinds "
        "of conversation verified exact (plain, system, multi-turn, tools, parallel tools, reasoning) and those the "
        "template cannot render. Exits 1 when there is no verified masking.",
    )
    detect.add_argument("tokenizer", metavar="TOKENIZER", help="tokenizer folder (tokenizer.json + tokenizer_config.json)")
    detect.add_argument("--model-name", metavar="NAME", help="model name, for the template table when detection fails")
    detect.add_argument("--json", action="store_true", help="print JSON (markers, decoded text, source, verification)")
    detect.set_defaults(run=_detect)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lossmask", description="Decide, for every token of every training row, whether it counts in the loss."
    )
    from . import __version__

    parser.add_argument("--version", action="version", version=f"lossmask {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    example = commands.add_parser("example", help="label a bundled ChatML-like sample and show what trains")
    example.set_defaults(run=_example)
    _add_mask_command(commands)
    _add_show_commands(commands)
    commands.add_parser("lora", add_help=False, help="mlx-lm's LoRA / DoRA / full fine-tuning on lossmask's masks "
                        "(the flags and YAML file of `mlx_lm lora`; `lossmask lora -h` lists them)")
    return parser


def command() -> int:
    """The ``lossmask`` program (and ``python -m lossmask``): ``main`` in a process of its own, whose allocator is
    set for a long job first (``jobs.allocator``), which a caller of ``main`` from Python is spared."""
    from .jobs.allocator import keep_heaps_small

    keep_heaps_small()
    return main()


def main(argv: list[str] | None = None) -> int:
    """Run the command line ``argv`` (default ``sys.argv[1:]``) and return its exit status. Called from Python (a
    test, a notebook), it leaves the process as it found it: warning format, signal handlers, environment."""
    argv = sys.argv[1:] if argv is None else list(argv)
    with _quiet_transformers_advice():
        return _run(argv)


@contextmanager
def _quiet_transformers_advice():
    """transformers' advice on import ("PyTorch was not found ...") concerns its models, which no command but lora
    uses: silenced for the run, unless the caller set it; the environment is as it was afterwards."""
    name = "TRANSFORMERS_NO_ADVISORY_WARNINGS"
    if name in os.environ:
        yield
        return
    os.environ[name] = "1"
    try:
        yield
    finally:
        os.environ.pop(name, None)


def _run(argv: list[str]) -> int:
    if argv[:1] == ["lora"]:  # mlx-lm's own parser reads the rest (lossmask.lora)
        from .lora import main as lora_main

        return lora_main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "run", None) is None:
        parser.print_usage(sys.stderr)
        print("lossmask: error: a command is missing: example, mask, show, detect or lora (`lossmask -h` says what "
              "each does)", file=sys.stderr)
        return 2
    try:
        code = args.run(args)
        sys.stdout.flush()  # here, where a closed pipe can be told apart, not at the interpreter's exit
    except BrokenPipeError:  # `lossmask mask ... | head`: the reader went away; whatever was committed stays
        _quiet_stdout()
        return 0
    return code


def _quiet_stdout() -> None:
    """Point stdout at /dev/null, so that the interpreter's last flush of a closed pipe says nothing."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError):  # no file descriptor (stdout replaced in-process)
        pass

"""Arrow chat rows to Python messages: the column-wise path gives what ``to_pylist`` gives, null keys dropped."""

from __future__ import annotations

import pyarrow as pa

from lossmask.chat.encode_batch import messages_from_arrow

ROWS = [
    [{"role": "user", "content": "hi", "tool_calls": None}, None,
     {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{}"}}]}],
    None,
    [],
    [{"role": "user", "content": "x", "tool_calls": None}, {"role": "assistant", "content": "", "tool_calls": None}],
]


def _by_rows(column):
    def message(m):
        return None if m is None else {k: v for k, v in m.items() if v is not None}

    return [None if row is None else [message(m) for m in row] for row in column.to_pylist()]


def test_struct_messages_equal_the_row_by_row_conversion():
    arr = pa.array(ROWS)
    cases = [arr, arr.slice(1), arr.slice(2, 2), arr.slice(3), arr.slice(0, 0), pa.chunked_array([arr, arr.slice(3)]),
             arr.cast(pa.large_list(arr.type.value_type)), pa.array([[]] * 3, type=arr.type)]
    for column in cases:
        assert messages_from_arrow(column) == _by_rows(column)
    assert messages_from_arrow(arr)[0] == [
        {"role": "user", "content": "hi"}, None,
        {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{}"}}]},
    ]


def test_json_object_messages_are_parsed():
    column = pa.array([['{"role": "user", "content": "a", "x": null}'], None])
    assert messages_from_arrow(column) == [[{"role": "user", "content": "a"}], None]

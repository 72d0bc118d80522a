"""``hidden-states status``: which layout it counts an input's rows in. ``convert`` rewrites the files
in another layout but keeps their rows (one per conversation, or one per reply) as the extraction made
them; the rows are counted in that layout. A real extraction converted both ways and back, counted by
``status``: tests/e2e/test_formats.py."""
from hidden_states.status import rows_layout

O3, O5 = "speculators-0.3", "speculators-0.5"


def test_the_recorded_layout_counts_the_rows_whatever_the_files_are_now():
    # extracted in 0.3, converted to 0.5, and from there back to 0.3: the rows are 0.3's throughout
    converted = {"format": {"name": O5}, "converted_from": {"format": O3}}
    back = {"format": {"name": O3}, "converted_from": {"format": O5}}
    assert rows_layout(converted, {"layout": O3}) == O3
    assert rows_layout(back, {"layout": O3}) == O3


def test_without_a_recorded_layout_the_converted_sources_then_the_directorys_own():
    assert rows_layout({"format": {"name": O5}, "converted_from": {"format": O3}}, {"max_seq_len": 8}) == O3
    assert rows_layout({"format": {"name": O5}}, {"max_seq_len": 8}) == O5
    assert rows_layout({}, {}) == O3  # written before formats had names

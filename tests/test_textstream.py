"""Stop strings are matched across pieces of text and never returned."""

from __future__ import annotations

from jetshard_worker.text.textstream import StopText


class PieceDetokenizer:
    """Stands in for mlx-lm's streaming detokenizer: token i decodes to pieces[i]."""

    def __init__(self, pieces: list[str]) -> None:
        self.pieces = pieces
        self.last_segment = ""

    def add_token(self, token: int) -> None:
        self.last_segment = self.pieces[token]

    def finalize(self) -> None:
        self.last_segment = ""


def run(pieces: list[str], stop: tuple[str, ...]) -> tuple[str, str | None]:
    """The text let through, and the stop string it ended at."""
    text = StopText(stop)
    out = ""
    for piece in pieces:
        out += text.add(piece)
        if text.stopped:
            break
    return out + text.finish(), text.matched


def test_stop_string_split_over_pieces_is_cut_and_not_returned() -> None:
    assert run(["Hello", " wor", "ld.", " EN", "D more"], ("END",)) == ("Hello world. ", "END")


def test_held_back_prefix_is_released_when_it_turns_out_not_to_be_a_stop() -> None:
    assert run(["a", "E", "N", "x", "b"], ("END",)) == ("aENxb", None)


def test_a_held_back_prefix_is_released_when_the_text_ends() -> None:
    assert run(["a", "EN"], ("END",)) == ("aEN", None)


def test_the_earliest_of_several_stop_strings_wins_within_one_piece() -> None:
    assert run(["one\n\ntwo###"], ("###", "\n\n")) == ("one", "\n\n")


def test_no_stop_strings_passes_text_through() -> None:
    assert run(["a", "b", "c"], ()) == ("abc", None)

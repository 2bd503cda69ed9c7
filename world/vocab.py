"""Names the world speaks about: colours, shapes, sizes, positions, numbers, sign words."""

from __future__ import annotations

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 80, 225),
    "yellow": (240, 215, 40),
    "purple": (145, 60, 185),
    "orange": (245, 140, 30),
    "white": (248, 248, 248),
    "black": (18, 18, 18),
}
COLOUR_NAMES = tuple(COLOURS)
SHAPES = ("circle", "square", "triangle", "star", "diamond", "cross")
SIZES = {"small": 24, "large": 46}  # bounding box side in pixels
# 3 x 3 layout cells (row, col) -> names used in answers
POSITIONS = {
    (0, 0): "top left", (0, 1): "top", (0, 2): "top right",
    (1, 0): "left", (1, 1): "center", (1, 2): "right",
    (2, 0): "bottom left", (2, 1): "bottom", (2, 2): "bottom right",
}
NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
ORDINALS = ("first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth")
SIGN_WORDS = (
    "stop", "exit", "open", "closed", "sale", "park", "cafe", "bank", "hotel", "taxi", "bus", "shop",
    "food", "zoo", "farm", "lake", "road", "gate", "east", "west", "north", "south", "slow", "push",
)
BACKGROUNDS = {"gray": (128, 128, 128), "dark gray": (84, 84, 90), "light gray": (176, 176, 170), "brown": (120, 92, 70)}

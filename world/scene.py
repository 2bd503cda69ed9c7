"""Scenes of objects: sampling, rendering, and the scene tasks (short VQA, detailed captions, reasoning)."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from PIL import Image

from specula.world.draw import Canvas
from specula.world.phrasing import article, clean, join_list, maybe, maybe_suffix, pick, sentence, SHORT_SUFFIX
from specula.world.sample import IMAGE_SIZE, Sample
from specula.world.vocab import BACKGROUNDS, COLOURS, COLOUR_NAMES, NUMBER_WORDS, POSITIONS, SHAPES, SIZES

CELL = IMAGE_SIZE // 3


@dataclass(frozen=True)
class Obj:
    shape: str
    colour: str
    size: str
    cell: tuple[int, int]  # (row, col) in the 3 x 3 layout
    cx: float
    cy: float
    behind: int | None = None  # index of the object this one partly covers (drawn after it)

    @property
    def name(self) -> str:
        return f"{self.colour} {self.shape}"

    @property
    def where(self) -> str:
        return POSITIONS[self.cell]


@dataclass(frozen=True)
class Scene:
    objects: tuple[Obj, ...]
    background: str


def sample_scene(rng: random.Random, n_min: int = 1, n_max: int = 5, allow_overlap: bool = True,
                 colours: Sequence[str] = COLOUR_NAMES, shapes: Sequence[str] = SHAPES) -> Scene:
    """Objects with distinct (colour, shape) pairs in distinct cells; sometimes one pair overlaps.

    ``colours`` / ``shapes``: the palette the objects are drawn from (the defaults draw the same random stream as
    always; a smaller palette makes objects share words, see ``sample_confusable_scene``)."""
    if n_max > len(colours) * len(shapes):
        raise ValueError(f"{n_max} objects need {n_max} distinct (colour, shape) pairs; the palette has "
                         f"{len(colours)} x {len(shapes)}")
    n = rng.randint(n_min, n_max)
    cells = rng.sample(sorted(POSITIONS), n)
    pairs: set[tuple[str, str]] = set()
    objs: list[Obj] = []
    bg = pick(rng, sorted(BACKGROUNDS))
    for cell in cells:
        while True:
            colour, shape = pick(rng, colours), pick(rng, shapes)
            if (colour, shape) not in pairs:
                break
        pairs.add((colour, shape))
        size = pick(rng, sorted(SIZES))
        jit = 6 if size == "large" else 12
        cx = cell[1] * CELL + CELL / 2 + rng.uniform(-jit, jit)
        cy = cell[0] * CELL + CELL / 2 + rng.uniform(-jit, jit)
        objs.append(Obj(shape, colour, size, cell, cx, cy))
    if allow_overlap and len(objs) >= 2 and rng.random() < 0.2:
        # move the last object onto the first one's cell, shifted: it is drawn later, so it covers part of it
        a = objs[0]
        dx, dy = rng.choice([(1, 0), (-1, 0), (0, 1), (0, -1)])
        shift = SIZES[a.size] * 0.55
        last = objs[-1]
        objs[-1] = Obj(last.shape, last.colour, "large" if a.size == "small" else last.size, a.cell,
                       a.cx + dx * shift, a.cy + dy * shift, behind=0)
    return Scene(tuple(objs), bg)


def sample_confusable_scene(rng: random.Random, n_min: int = 3, n_max: int = 5) -> Scene:
    """A scene whose objects share words: drawn from 2 colours x 3 shapes (or 3 x 2), so most objects are named
    by colour *and* shape ("the yellow cross" beside a white cross and a yellow square). These are the lookups a
    small LM gets wrong in crowded scenes: it answers with the attribute of an object that shares one word with the
    asked one (zoo/TRAINING.md, "Confusable scenes"). Training only: the evaluation suites keep ``sample_scene``."""
    k = rng.choice(((2, 3), (3, 2)))
    palette = rng.sample(COLOUR_NAMES, k[0]), rng.sample(SHAPES, k[1])
    return sample_scene(rng, n_min, n_max, colours=palette[0], shapes=palette[1])


def render_scene(scene: Scene, rng: random.Random) -> tuple[Image.Image, tuple]:
    canvas = Canvas.new(BACKGROUNDS[scene.background], rng)
    for o in scene.objects:
        # patch words: what a caption or answer would say about this object (colour, shape, size, place)
        words = (o.colour, o.shape, o.size, *o.where.split())
        canvas.shape(o.shape, o.cx, o.cy, SIZES[o.size] / 2, COLOURS[o.colour], words)
    return canvas.image, canvas.patch_words()


def _ref(o: Obj, scene: Scene) -> str:
    """Shortest unique reference to an object: its shape if unique, else its colour, else both."""
    shapes = [x.shape for x in scene.objects]
    colours = [x.colour for x in scene.objects]
    if shapes.count(o.shape) == 1:
        return o.shape
    if colours.count(o.colour) == 1:
        return f"{o.colour} object"
    return o.name


# ----------------------------------------------------------------------------------------------- short VQA

def vqa(rng: random.Random, scene: Scene) -> tuple[str, str, int]:
    """One short-answer question about the scene: (question, answer, number of possible answers)."""
    q, a, n, _ = vqa_typed(rng, scene)
    return q, a, n


def vqa_typed(rng: random.Random, scene: Scene) -> tuple[str, str, int, str]:
    """``vqa`` plus the question's type (colour, shape, count, count_colour, exists, size, relation, where)."""
    objs = scene.objects
    kind = pick(rng, ("colour", "shape", "count", "count_colour", "exists", "where", "size", "relation"))
    o = objs[rng.randrange(len(objs))]
    if kind == "colour":
        if [x.shape for x in objs].count(o.shape) == 1:
            q = pick(rng, ("What colour is the {s}?", "Which colour does the {s} have?", "What is the colour of the {s}?",
                           "The {s} is what colour?")).format(s=o.shape)
            return q, o.colour, len(COLOUR_NAMES), "colour"
        kind = "shape"
    if kind == "shape":
        if [x.colour for x in objs].count(o.colour) == 1:
            q = pick(rng, ("What shape is the {c} object?", "Which shape is {c}?", "What is the shape of the {c} object?",
                           "The {c} object is what shape?")).format(c=o.colour)
            return q, o.shape, len(SHAPES), "shape"
        kind = "where"
    if kind == "count":
        q = pick(rng, ("How many objects are there?", "How many shapes are in the picture?",
                       "How many objects can you see?", "Count the objects in the image."))
        return q, NUMBER_WORDS[len(objs)], 5, "count"
    if kind == "count_colour":
        c = o.colour if rng.random() < 0.6 else pick(rng, COLOUR_NAMES)
        n = sum(x.colour == c for x in objs)
        q = pick(rng, ("How many {c} objects are there?", "How many {c} shapes can you see?",
                       "Count the {c} objects.")).format(c=c)
        return q, NUMBER_WORDS[n], 4, "count_colour"
    if kind == "exists":
        if rng.random() < 0.5:
            c, s = o.colour, o.shape
        else:
            present = {(x.colour, x.shape) for x in objs}
            while True:
                # a near miss half the time: a present shape in another colour
                s = o.shape if rng.random() < 0.5 else pick(rng, SHAPES)
                c = pick(rng, COLOUR_NAMES)
                if (c, s) not in present:
                    break
        yes = any(x.colour == c and x.shape == s for x in objs)
        q = pick(rng, ("Is there {a} {c} {s}?", "Is there {a} {c} {s} in the image?", "Can you see {a} {c} {s}?",
                       "Does the picture contain {a} {c} {s}?")).format(a=article(c), c=c, s=s)
        return q, "yes" if yes else "no", 2, "exists"
    if kind == "size":
        q = pick(rng, ("Is the {r} large or small?", "Is the {r} small or large?", "What size is the {r}?")).format(r=_ref(o, scene))
        return q, o.size, 2, "size"
    if kind == "relation" and len(objs) >= 2:
        a, b = rng.sample(list(objs), 2)
        if a.cell[1] != b.cell[1] and rng.random() < 0.5:
            q = pick(rng, ("Is the {a} to the left of the {b}?", "Is the {a} left of the {b}?")).format(a=_ref(a, scene), b=_ref(b, scene))
            return q, "yes" if a.cx < b.cx else "no", 2, "relation"
        if a.cell[0] != b.cell[0]:
            q = pick(rng, ("Is the {a} above the {b}?", "Is the {a} higher than the {b}?")).format(a=_ref(a, scene), b=_ref(b, scene))
            return q, "yes" if a.cy < b.cy else "no", 2, "relation"
    q = pick(rng, ("Where is the {r}?", "In which part of the image is the {r}?", "Where is the {r} located?")).format(r=_ref(o, scene))
    return q, o.where, len(POSITIONS), "where"


# ----------------------------------------------------------------------------------------------- captions

def _describe(rng: random.Random, o: Obj) -> str:
    size = o.size
    where = pick(rng, ("in the {w}", "at the {w}", "near the {w}", "in the {w} area")).format(w=o.where)
    if o.where == "center":
        where = pick(rng, ("in the center", "in the middle", "at the center"))
    body = pick(rng, ("{a} {z} {c} {s}", "{a} {z} {c} {s}", "{a} {c} {s} of {z} size"))
    body = body.format(a=article(size if "{z} {c}" in body else o.colour), z=size, c=o.colour, s=o.shape)
    return f"{body} {where}"


def _short(o: Obj) -> str:
    return f"{article(o.size)} {o.size} {o.colour} {o.shape}"


def scan_listing(scene: Scene) -> str:
    """Every cell of the 3 x 3 layout in reading order with what it holds: "top left, a large purple cross; top, no
    object; ...". Objects sharing a cell (one partly covers the other) are joined by "and", the covered one first."""
    here: dict[tuple[int, int], list[Obj]] = {}
    for o in scene.objects:
        here.setdefault(o.cell, []).append(o)
    return "; ".join(f"{name}, {' and '.join(_short(o) for o in here[cell]) if cell in here else 'no object'}"
                     for cell, name in POSITIONS.items())


def colour_listing(scene: Scene) -> str:
    """Every colour of the world in a fixed order with the objects of that colour: "red, a small circle at the top
    left and a large star in the center; green, no object; ...". Each entry is a lookup by colour, the word every
    visual token carries loudest (and only one of per object), where the cell scan's lookup by place has to tell
    "bottom left" from "bottom" on tokens that carry "bottom" in both. It names every colour word whatever the image,
    so the word recall cannot judge it: read it with ``training/target/quality.py`` ``object_recall`` (zoo/TRAINING.md, "What a
    cell's phrase gets wrong": it stayed behind the cell scan)."""
    def phrase(o: Obj) -> str:
        where = "in the center" if o.where == "center" else f"at the {o.where}"
        return f"{article(o.size)} {o.size} {o.shape} {where}"

    parts = []
    for c in COLOUR_NAMES:
        mine = sorted((o for o in scene.objects if o.colour == c), key=lambda o: o.cell)  # reading order
        parts.append(f"{c}, {' and '.join(phrase(o) for o in mine) if mine else 'no object'}")
    return "; ".join(parts)


SCAN_OPENERS = ("in the image", "this picture shows", "the image shows", "we can see", "in this picture",
                "the scene shows")


def caption(rng: random.Random, scene: Scene, scan: bool = False, by_colour: bool = False) -> tuple[str, tuple[str, ...]]:
    """A detailed caption naming every object's colour, shape, size and place, with optional relations.

    ``scan``: the listing names all nine cells in reading order with what each holds (``scan_listing``) instead of
    the objects alone. A small LM that lists only the objects has to know which ones it has named already, and the
    8-layer target's captions fail exactly there: they name one object again and again and skip others (attribute
    recall 0.70; zoo/TRAINING.md, "Captions that scan the cells"). With the cell named first, every object phrase is
    a lookup by place. ``by_colour``: the listing goes through the colours instead (``colour_listing``), each
    object phrase a lookup by colour. All forms draw the same random numbers, so every pick after the caption (the
    prompt's included) is the same either way.
    """
    objs = list(scene.objects)
    order = objs[:]
    rng.shuffle(order)
    phrases = {id(o): _describe(rng, o) for o in order}  # drawn in the shuffled order: the random stream is unchanged
    # ...but listed in reading order (cell by cell, top row first): a small LM that has to name every object once can
    # then scan the image instead of remembering which objects it has named (zoo/TRAINING.md, "Captions in reading
    # order").
    n = len(objs)
    listed = join_list(rng, [phrases[id(o)] for o in sorted(objs, key=lambda o: o.cell)])  # drawn in both forms
    k = rng.randrange(6)
    if scan or by_colour:
        text = sentence(f"{SCAN_OPENERS[k]}: {colour_listing(scene) if by_colour else scan_listing(scene)}.")
    else:
        be, count = ("is" if n == 1 else "are"), f"{NUMBER_WORDS[n]} object{'s' if n > 1 else ''}"
        text = sentence((
            "The image shows {l}.", "This picture contains {l}.", "In this image there {be} {l}.",
            "There {be} {k} in this image: {l}.", "We can see {l}.", "The scene has {k}: {l}.",
        )[k].format(l=listed, be=be, k=count))
    if rng.random() < 0.6:
        text += " " + sentence(pick(rng, ("the background is {b}.", "everything sits on a {b} background.",
                                           "the objects are on a {b} background."))).format(b=scene.background)
    for o in objs:
        if o.behind is not None:
            u = objs[o.behind]
            text += " " + sentence(pick(rng, ("the {a} partly covers the {b}.", "the {b} is partly hidden behind the {a}.",
                                               "the {a} overlaps the {b}."))).format(a=o.name, b=u.name)
    if n >= 2 and rng.random() < 0.5:
        a, b = rng.sample(objs, 2)
        if a.cx < b.cx - 20:
            text += " " + sentence(f"the {a.name} is to the left of the {b.name}.")
        elif a.cy < b.cy - 20:
            text += " " + sentence(f"the {a.name} is above the {b.name}.")
    attrs = tuple(w for o in objs for w in (o.colour, o.shape))
    return clean(text), attrs


CAPTION_PROMPTS = (
    "Describe the image in detail.", "Describe this picture.", "What do you see in this image?",
    "Give a detailed description of the image.", "Write a caption for this image.", "Describe the scene.",
)


# ----------------------------------------------------------------------------------------------- reasoning

def reasoning(rng: random.Random, scene: Scene) -> tuple[str, str, str]:
    """A question that needs a small argument: (question, full response, short answer)."""
    objs = list(scene.objects)
    n = len(objs)
    kind = pick(rng, ("compare", "remove", "leftmost", "same"))
    if kind == "compare":
        c1, c2 = rng.sample(COLOUR_NAMES, 2)
        if rng.random() < 0.6:
            c1 = pick(rng, [o.colour for o in objs])
        n1, n2 = sum(o.colour == c1 for o in objs), sum(o.colour == c2 for o in objs)
        ans = "yes" if n1 > n2 else "no"
        q = pick(rng, ("Are there more {a} objects than {b} objects?", "Do {a} objects outnumber {b} ones?")).format(a=c1, b=c2)
        because = f"there {'is' if n1 == 1 else 'are'} {NUMBER_WORDS[n1]} {c1} object{'s' if n1 != 1 else ''} and " \
                  f"{NUMBER_WORDS[n2]} {c2} object{'s' if n2 != 1 else ''}"
        concl = (f"so the {c1} ones are more numerous" if n1 > n2 else
                 f"so they are equal in number" if n1 == n2 else f"so the {c2} ones are more numerous")
        resp = f"{sentence(ans)}. " + sentence(pick(rng, ("{b}, {c}.", "I count {b}, {c}.", "Looking at the image, {b}, {c}.")).format(b=because, c=concl))
        return q, resp, ans
    if kind == "remove":
        o = rng.choice(objs)
        q = pick(rng, ("If the {r} were removed, how many objects would remain?", "How many objects would be left without the {r}?")).format(r=o.name)
        ans = NUMBER_WORDS[n - 1]
        resp = f"{sentence(ans)}. " + sentence(pick(rng, (
            "there are {k} objects in total, and taking away the {r} leaves {m}.",
            "the image has {k} objects; without the {r} only {m} remain{s}.",
        )).format(k=NUMBER_WORDS[n], r=o.name, m=NUMBER_WORDS[n - 1], s="s" if n - 1 == 1 else ""))
        return q, resp, ans
    if kind == "leftmost" and n >= 2:
        o = min(objs, key=lambda x: x.cx)
        q = pick(rng, ("Which object is furthest to the left?", "Which shape is closest to the left edge?"))
        ans = f"the {o.name}"
        others = join_list(rng, [f"the {x.name}" for x in objs if x is not o])
        resp = f"{sentence(ans)}. " + sentence(pick(rng, (
            "it is in the {w} part of the image, while {others} {be} further right.",
            "{others} {be} all to its right, since it sits at the {w}.",
        )).format(w=o.where, others=others, be="is" if n == 2 else "are"))
        return q, resp, ans
    # same: do two named objects share colour or shape?
    if n >= 2:
        a, b = rng.sample(objs, 2)
        same = a.colour == b.colour
        q = f"Do the {a.shape} and the {b.shape} have the same colour?" if a.shape != b.shape else \
            f"Is the {a.name} the same colour as the {b.name}?"
        ans = "yes" if same else "no"
        resp = f"{sentence(ans)}. " + sentence(f"the {a.shape} is {a.colour} and the {b.shape} is {b.colour}" +
                                               (", so they match." if same else ", so they differ."))
        return q, resp, ans
    o = objs[0]
    q = "How many objects are in the image, and what is it?"
    return q, f"One. It is {article(o.size)} {o.size} {o.colour} {o.shape} in the {o.where}.", "one"


# ----------------------------------------------------------------------------------------------- samplers

def make(rng: random.Random, suite: str, task: str, n_min: int = 1, n_max: int = 5, scan: bool = False,
         by_colour: bool = False) -> Sample:
    """One scene sample of ``task`` (vqa, caption, reasoning); ``scan``: captions scan the cells, ``by_colour``: they
    go through the colours (``caption``)."""
    scene = sample_scene(rng, n_min, n_max)
    img, pw = render_scene(scene, rng)
    if task == "vqa":
        q, a, k, qtype = vqa_typed(rng, scene)
        prompt = f"<image>{q} {pick(rng, SHORT_SUFFIX)}" if rng.random() < 0.8 else f"<image>{q}"
        return Sample(suite, f"vqa/{qtype}", (img,), prompt, a, a, k, (), (pw,))
    if task == "caption":
        text, attrs = caption(rng, scene, scan=scan, by_colour=by_colour)
        return Sample(suite, "caption", (img,), "<image>" + pick(rng, CAPTION_PROMPTS), text, None, None, attrs, (pw,))
    if task == "reasoning":
        q, resp, a = reasoning(rng, scene)
        suffix = pick(rng, ("Explain your answer.", "Explain why.", "Give your reasoning.", ""))
        return Sample(suite, "reasoning", (img,), clean(f"<image>{q} {suffix}"), resp, a, None, (), (pw,))
    raise ValueError(f"unknown scene task {task!r}")


def make_dialogue(rng: random.Random, suite: str, task: str, n_turns: int = 12, n_min: int = 1,
                  n_max: int = 5, confusable: bool = False) -> Sample:
    """A training dialogue: one scene, then up to ``n_turns`` distinct short questions about it as successive turns.

    The first turn is exactly an evaluation-format VQA prompt; the follow-ups reuse the image's visual tokens, so
    one forward pass trains many grounded answers (a single-question sample spends ~80% of its tokens on the image).
    ``confusable``: the scene comes from ``sample_confusable_scene``.
    """
    scene = sample_confusable_scene(rng, n_min, n_max) if confusable else sample_scene(rng, n_min, n_max)
    img, pw = render_scene(scene, rng)
    (q0, a0), *rest = dialogue_turns(rng, scene, n_turns)
    return Sample(suite, "vqa_dialogue", (img,), f"<image>{q0}", a0, a0, None, (), (pw,), tuple(rest))


def dialogue_turns(rng: random.Random, scene: Scene, n_turns: int) -> list[tuple[str, str]]:
    """Up to ``n_turns`` distinct short (question, answer) pairs about ``scene``; half carry an answer-format
    suffix."""
    turns: list[tuple[str, str]] = []
    seen: set[str] = set()
    for _ in range(4 * n_turns):
        if len(turns) == n_turns:
            break
        q, a, _ = vqa(rng, scene)
        if q not in seen:
            seen.add(q)
            turns.append((maybe_suffix(rng, q), a))
    return turns

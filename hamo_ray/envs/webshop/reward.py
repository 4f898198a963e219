"""WebShop's published reward (``web_agent_site/engine/goal.py``, ``get_reward``), in pure Python.

The score of a purchase is::

    r = (attributes matched + options matched + [price <= price_upper])
        / (#goal attributes + #goal options + 1)  *  r_type

with ``r_type`` in {0, 0.1, 0.5, 1} from the purchased product's query, category path and title nouns
against the goal's. Each part mirrors its function in ``goal.py``:

- ``type_reward``: ``query_match`` (same search query), ``category_match`` (>= 2 shared elements of the
  ``›``-separated category path), ``title_score`` = shared title nouns / goal title nouns (0.2 when the
  goal title has none). ``r_type`` = 1; 0.5 when none of the three matches (title_score <= 0.2);
  0.1 when title_score < 0.1; 0 when title_score == 0. The real code tags nouns with spaCy
  (``en_core_web_lg``, NOUN/PROPN); the stand-in catalogue knows its title nouns at generation time
  (brand = proper noun, product-type words = nouns), so products carry them (``title_nouns``).
- ``attribute_reward``: a goal attribute matches when a product attribute scores
  ``token_set_ratio > 85``, else when it is a substring of the title, bullet points or description.
- ``option_reward``: per *purchased* option (colours normalised by ``normalize_color``): ``size``
  needs an exact match among the goal options, others ``token_set_ratio > 85``; else a substring of
  title/bullets/description counts.
- ``token_set_ratio`` is ``thefuzz.fuzz.token_set_ratio`` (rapidfuzz's algorithm: token sets,
  Indel-normalised similarity, rounded to an int), re-implemented here without the dependency.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

EXACT_MATCH_OPTS = ("size",)
PRICE_RANGE = [10.0 * i for i in range(1, 100)]

# WebShop's colour vocabulary (engine/normalize.py COLOR_SET, alphabetical): an option value is
# normalised to the first entry it contains ("navy blue" -> "blue").
COLOR_SET = (
    "alabaster apricot aqua ash asphalt azure banana beige black blue blush bordeaux bronze brown "
    "burgundy camel camo caramel champagne charcoal cheetah chestnut chocolate christmas coffee cognac "
    "copper coral cranberry cream crystal dark denim eggplant elephant espresso fuchsia gold granite "
    "grape graphite grass gray green grey heather indigo ivory ivy khaki lavender lemon leopard light "
    "lilac lime magenta maroon mauve merlot midnight mint mocha multicolor mushroom mustard natural navy "
    "nude olive orange peach pewter pink plum purple rainbow red rose royal rust sand sapphire seashell "
    "silver skull slate steel stone stonewash sunflower tan taupe teal tiger turquoise violet walnut "
    "wheat white wine yellow"
).split()

_NON_ALNUM = re.compile(r"[^0-9a-zA-Z]+")


@dataclass(frozen=True)
class Product:
    """One catalogue item, with the fields ``goal.py`` reads (``Title``, ``Attributes``, ...)."""

    asin: str
    title: str
    category: str  # top-level category (the stand-in's task type)
    query: str  # the search query the product was "scraped" under
    product_category: str  # "A › B › C" path
    attributes: tuple[str, ...]
    bullet_points: tuple[str, ...] = ()
    description: str = ""
    options: dict[str, tuple[str, ...]] = field(default_factory=dict)
    price: float = 100.0
    title_nouns: tuple[str, ...] = ()  # NOUN/PROPN tokens of the title, lowercased
    rating: str = "N.A."
    reviews: tuple[tuple[str, str, str], ...] = ()  # (title, score, body)


@dataclass(frozen=True)
class Goal:
    """An instruction and the constraints it was generated from (``get_goals`` output)."""

    asin: str  # the target product
    instruction_text: str
    category: str
    query: str
    name: str  # the target's title
    name_nouns: tuple[str, ...]
    product_category: str
    attributes: tuple[str, ...]
    goal_options: dict[str, str]
    price_upper: float


@dataclass(frozen=True)
class RewardInfo:
    reward: float  # 0-1
    r_type: float
    num_attr_matches: int
    num_option_matches: int
    r_price: bool
    query_match: bool
    category_match: bool
    title_score: float


def _process(s: str) -> str:
    """thefuzz ``full_process`` with ``force_ascii``: ASCII only, non-alphanumerics to spaces, lowercase."""
    s = s.encode("ascii", "ignore").decode()
    return _NON_ALNUM.sub(" ", s).lower().strip()


def _indel_distance(a: str, b: str) -> int:
    """Insertions + deletions turning ``a`` into ``b`` (len(a) + len(b) - 2 * LCS)."""
    if not a or not b:
        return len(a) + len(b)
    prev = [0] * (len(b) + 1)
    for ca in a:
        cur = [0]
        for j, cb in enumerate(b):
            cur.append(prev[j] + 1 if ca == cb else max(prev[j + 1], cur[j]))
        prev = cur
    return len(a) + len(b) - 2 * prev[-1]


def _norm(dist: int, lensum: int) -> float:
    return 100.0 if lensum == 0 else 100.0 - 100.0 * dist / lensum


def token_set_ratio(s1: str, s2: str) -> int:
    """``thefuzz.fuzz.token_set_ratio`` (0-100, an int)."""
    p1, p2 = _process(s1), _process(s2)
    if not p1 or not p2:
        return 0
    a, b = set(p1.split()), set(p2.split())
    sect, diff_ab, diff_ba = a & b, a - b, b - a
    if sect and (not diff_ab or not diff_ba):
        return 100
    ab, ba = " ".join(sorted(diff_ab)), " ".join(sorted(diff_ba))
    sect_len = len(" ".join(sect))
    sect_ab_len = sect_len + (sect_len != 0) + len(ab)
    sect_ba_len = sect_len + (sect_len != 0) + len(ba)
    result = _norm(_indel_distance(ab, ba), sect_ab_len + sect_ba_len)
    if sect_len:
        result = max(
            result,
            _norm(1 + len(ab), sect_len + sect_ab_len),
            _norm(1 + len(ba), sect_len + sect_ba_len),
        )
    return int(round(result))


def normalize_color(color: str) -> str:
    """The first WebShop colour contained in ``color``, else ``color`` unchanged."""
    for base in COLOR_SET:
        if base in color:
            return base
    return color


def _in_text(needle: str, product: Product) -> bool:
    return (
        needle in product.title.lower()
        or needle in " ".join(product.bullet_points).lower()
        or needle in product.description.lower()
    )


def type_reward(purchased: Product, goal: Goal) -> tuple[float, bool, bool, float]:
    """(r_type, query_match, category_match, title_score) as in ``get_type_reward``."""
    query_match = purchased.query == goal.query
    bought_path = {x.strip() for x in purchased.product_category.split("›")}
    goal_path = {x.strip() for x in goal.product_category.split("›")}
    category_match = len(bought_path & goal_path) >= 2
    desired = set(goal.name_nouns)
    title_score = 0.2 if not desired else len(set(purchased.title_nouns) & desired) / len(desired)
    r_type = 1.0
    if not (query_match or category_match or title_score > 0.2):
        r_type = 0.5
    if title_score < 0.1:
        r_type = 0.1
    if title_score == 0.0:
        r_type = 0.0
    return r_type, query_match, category_match, title_score


def attribute_reward(purchased: Product, goal: Goal) -> int:
    """Number of goal attributes the purchased product has (fuzzy, or in its text)."""
    matches = 0
    for g_attr in goal.attributes:
        if any(token_set_ratio(p_attr, g_attr) > 85 for p_attr in purchased.attributes) or _in_text(
            g_attr, purchased
        ):
            matches += 1
    return matches


def option_reward(purchased: Product, goal_options: list[str], options: dict[str, str]) -> int:
    """Number of purchased options that match a goal option (exact for size, fuzzy otherwise)."""
    chosen = {k: normalize_color(v) for k, v in options.items()}
    wanted = [normalize_color(o) for o in goal_options]
    matches = 0
    for key, value in chosen.items():
        if key.lower() in EXACT_MATCH_OPTS:
            matched = value in wanted
        else:
            matched = any(token_set_ratio(g, value) > 85 for g in wanted)
        if matched or _in_text(value, purchased):
            matches += 1
    return matches


def get_reward(purchased: Product, goal: Goal, price: float, options: dict[str, str]) -> RewardInfo:
    """WebShop's reward (0-1) for buying ``purchased`` at ``price`` with the chosen ``options``."""
    r_type, query_match, category_match, title_score = type_reward(purchased, goal)
    r_price = price <= goal.price_upper
    n_attr = attribute_reward(purchased, goal)
    n_opt = option_reward(purchased, list(goal.goal_options.values()), options)
    total = (n_attr + n_opt + r_price) / (len(goal.attributes) + len(goal.goal_options) + 1)
    return RewardInfo(
        reward=total * r_type,
        r_type=r_type,
        num_attr_matches=n_attr,
        num_option_matches=n_opt,
        r_price=r_price,
        query_match=query_match,
        category_match=category_match,
        title_score=title_score,
    )

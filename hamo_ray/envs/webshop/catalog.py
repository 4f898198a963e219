"""The WebShop stand-in's generated product catalogue and instructions (deterministic by seed).

This is generated data, not WebShop's 1.18M scraped Amazon products. Five top-level categories, the
task types (WebShop's own five: beauty, electronics, fashion, furniture, grocery), each with five product
types. A product type has a search query, a ``›`` category path, a pool of attribute phrases, option
names with value pools and a price range. A product draws a brand, a title, three attributes, a few
values of each option and a price; its bullet points and description restate its attributes.

Each product yields one instruction (texts are unique: a product whose draws keep repeating an
earlier text after 20 tries gets none), generated like WebShop's synthetic goals (``get_synthetic_goals``):
a template over 1-3 of the product's attributes and its product type, then ``" with <option>: <value>,
and ..."`` (one value per option, option names sorted) and ``", and price lower than <X> dollars"``
with ``X`` drawn as in ``get_human_goals`` (two of the four next multiples of 10 above the price, the
larger). Per category the products are shuffled and cut 70/10/20 into train/dev/test, so the
instructions (and their target products) of the three splits are disjoint. A task's ``variation`` is
the instruction's index in its category: train ``[0, a)``, dev ``[a, b)``, test ``[b, n)``.

Usage::

    cat = build_catalog(seed=0, num_products=3000)      # cached per (seed, num_products, ids)
    goal = cat.goal("fashion", 5)
    product = cat.products[goal.asin]
"""

from __future__ import annotations

import functools
import logging
import random
import string
from dataclasses import dataclass

from hamo_ray.envs.webshop.reward import PRICE_RANGE, Goal, Product
from hamo_ray.envs.webshop.search import BM25Index

logger = logging.getLogger(__name__)

_SPLIT_FRACTIONS = (0.7, 0.1, 0.2)

_SIZES_CLOTHES = ("x-small", "small", "medium", "large", "x-large", "xx-large")
_COLORS = ("black", "white", "navy blue", "grey", "red", "green", "beige", "pink", "brown", "purple")
_VOLUMES = ("2 fl oz", "8 fl oz", "16 fl oz", "32 fl oz")
_PACKS = ("pack of 1", "pack of 2", "pack of 6", "pack of 12")

# fmt: off
# category -> [(noun phrase, query, category path, attribute pool, {option: values}, (price lo, hi))]
PRODUCT_TYPES: dict[str, list[tuple[str, str, str, tuple[str, ...], dict[str, tuple[str, ...]], tuple[int, int]]]] = {
    "beauty": [
        ("argan oil shampoo", "shampoo", "Beauty & Personal Care › Hair Care › Shampoo",
         ("sulfate free", "paraben free", "color safe", "dry hair", "cruelty free", "natural ingredients", "dandruff control", "salon quality"),
         {"size": _VOLUMES, "scent": ("lavender", "coconut", "rosemary", "unscented")}, (6, 40)),
        ("face moisturizer", "face moisturizer", "Beauty & Personal Care › Skin Care › Face Moisturizers",
         ("fragrance free", "sensitive skin", "hyaluronic acid", "oil free", "spf 30", "anti aging", "vegan formula", "dermatologist tested"),
         {"size": ("1.7 oz", "2.5 oz", "4 oz")}, (9, 60)),
        ("nail polish", "nail polish", "Beauty & Personal Care › Makeup › Nails › Nail Polish",
         ("quick drying", "long lasting", "high gloss", "chip resistant", "non toxic", "easy application", "gel effect", "travel friendly"),
         {"color": _COLORS}, (4, 25)),
        ("hair dryer", "hair dryer", "Beauty & Personal Care › Hair Care › Styling Tools › Hair Dryers",
         ("ionic technology", "low noise", "lightweight design", "cool shot button", "fast drying", "foldable handle", "ceramic heating", "overheat protection"),
         {"color": ("black", "white", "pink", "rose gold")}, (19, 120)),
        ("makeup brush set", "makeup brushes", "Beauty & Personal Care › Tools & Accessories › Makeup Brushes",
         ("synthetic bristles", "vegan friendly", "travel case", "easy to clean", "wooden handle", "soft touch", "dense blending", "gift box"),
         {"size": ("5 piece", "10 piece", "16 piece")}, (8, 45)),
    ],
    "electronics": [
        ("wireless earbuds", "wireless earbuds", "Electronics › Headphones › Earbud Headphones",
         ("noise cancelling", "bluetooth 5 3", "water resistant", "long battery life", "charging case", "touch control", "built in microphone", "low latency"),
         {"color": ("black", "white", "navy blue", "green")}, (19, 150)),
        ("usb c charger", "usb c charger", "Electronics › Accessories › Chargers & Adapters",
         ("fast charging", "foldable plug", "dual port", "gan technology", "compact size", "overcurrent protection", "travel ready", "universal compatibility"),
         {"size": ("20w", "45w", "65w", "100w")}, (9, 70)),
        ("portable speaker", "bluetooth speaker", "Electronics › Portable Audio › Speakers",
         ("waterproof", "deep bass", "stereo pairing", "24 hour playtime", "shockproof", "outdoor use", "hands free calls", "rgb lights"),
         {"color": ("black", "blue", "red", "grey")}, (19, 200)),
        ("hdmi cable", "hdmi cable", "Electronics › Accessories › Cables › HDMI Cables",
         ("4k support", "braided nylon", "gold plated", "high speed", "ethernet channel", "tangle free", "hdr compatible", "slim connector"),
         {"size": ("3 ft", "6 ft", "10 ft", "15 ft")}, (5, 30)),
        ("wireless mouse", "wireless mouse", "Electronics › Computers › Accessories › Mice",
         ("ergonomic design", "silent click", "rechargeable battery", "adjustable dpi", "usb receiver", "left handed", "plug and play", "long range"),
         {"color": ("black", "white", "grey", "pink")}, (8, 60)),
    ],
    "fashion": [
        ("crew neck t shirt", "men t shirts", "Clothing, Shoes & Jewelry › Men › Clothing › Shirts › T Shirts",
         ("short sleeve", "machine wash", "cotton blend", "slim fit", "moisture wicking", "tagless collar", "relaxed fit", "pre shrunk"),
         {"color": _COLORS, "size": _SIZES_CLOTHES}, (8, 35)),
        ("running shoes", "women running shoes", "Clothing, Shoes & Jewelry › Women › Shoes › Athletic › Running",
         ("breathable mesh", "rubber sole", "arch support", "non slip", "memory foam", "lace up", "lightweight build", "shock absorbing"),
         {"color": _COLORS, "size": ("6", "7", "8", "9", "10", "11")}, (25, 120)),
        ("pullover hoodie", "hoodies", "Clothing, Shoes & Jewelry › Women › Clothing › Fashion Hoodies & Sweatshirts",
         ("fleece lined", "kangaroo pocket", "drawstring hood", "long sleeve", "hand wash", "oversized fit", "ribbed cuffs", "polyester spandex"),
         {"color": _COLORS, "size": _SIZES_CLOTHES}, (15, 60)),
        ("denim jeans", "men jeans", "Clothing, Shoes & Jewelry › Men › Clothing › Jeans",
         ("straight leg", "stretch fabric", "button fly", "classic fit", "distressed look", "five pocket", "high waist", "machine washable"),
         {"color": ("light blue", "dark blue", "black", "grey"), "size": ("30w x 30l", "32w x 32l", "34w x 32l", "36w x 34l")}, (20, 90)),
        ("wool socks", "socks", "Clothing, Shoes & Jewelry › Men › Clothing › Socks",
         ("merino wool", "cushioned sole", "odor resistant", "hiking boot", "seamless toe", "warm winter", "crew length", "reinforced heel"),
         {"color": ("black", "grey", "brown", "navy blue"), "size": ("medium", "large", "x-large")}, (9, 30)),
    ],
    "furniture": [
        ("office chair", "office chair", "Home & Kitchen › Furniture › Home Office Furniture › Chairs",
         ("lumbar support", "adjustable height", "mesh back", "swivel base", "padded armrests", "easy assembly", "tilt lock", "heavy duty"),
         {"color": ("black", "grey", "white", "blue")}, (60, 350)),
        ("bookshelf", "bookshelf", "Home & Kitchen › Furniture › Living Room Furniture › Bookcases",
         ("5 tier", "engineered wood", "wall anchor", "industrial style", "open shelving", "space saving", "metal frame", "easy assembly"),
         {"color": ("walnut", "white", "black", "oak")}, (40, 260)),
        ("coffee table", "coffee table", "Home & Kitchen › Furniture › Living Room Furniture › Tables",
         ("lift top", "hidden storage", "solid wood", "rustic finish", "round shape", "tempered glass", "mid century", "scratch resistant"),
         {"color": ("walnut", "white", "black", "grey")}, (70, 400)),
        ("bed frame", "bed frame", "Home & Kitchen › Furniture › Bedroom Furniture › Beds & Frames",
         ("no box spring needed", "under bed storage", "noise free", "steel slats", "upholstered headboard", "tool free assembly", "platform design", "wood slats"),
         {"size": ("twin", "full", "queen", "king")}, (90, 600)),
        ("bar stool", "bar stools", "Home & Kitchen › Furniture › Kitchen & Dining Room Furniture › Stools",
         ("counter height", "swivel seat", "footrest", "faux leather", "set of 2", "backless design", "gas lift", "modern style"),
         {"color": ("black", "brown", "grey", "white")}, (40, 250)),
    ],
    "grocery": [
        ("roasted coffee beans", "coffee beans", "Grocery & Gourmet Food › Beverages › Coffee › Whole Bean",
         ("dark roast", "single origin", "fair trade", "usda organic", "low acid", "arabica beans", "small batch", "kosher certified"),
         {"flavor": ("original", "vanilla", "hazelnut", "mocha"), "size": ("12 ounce", "2 pound", "5 pound")}, (9, 60)),
        ("protein bar", "protein bars", "Grocery & Gourmet Food › Snacks › Bars › Protein",
         ("gluten free", "high protein", "low sugar", "keto friendly", "plant based", "non gmo", "no artificial sweeteners", "individually wrapped"),
         {"flavor": ("chocolate", "peanut butter", "cookie dough", "berry"), "size": _PACKS}, (10, 45)),
        ("green tea", "green tea", "Grocery & Gourmet Food › Beverages › Tea › Green",
         ("caffeine free", "loose leaf", "usda organic", "antioxidant rich", "biodegradable bags", "japanese sencha", "cold brew", "sugar free"),
         {"flavor": ("jasmine", "mint", "lemon", "original"), "size": ("20 count", "50 count", "100 count")}, (5, 30)),
        ("olive oil", "olive oil", "Grocery & Gourmet Food › Pantry › Oils › Olive",
         ("extra virgin", "cold pressed", "first harvest", "glass bottle", "single estate", "high polyphenol", "unfiltered", "mediterranean blend"),
         {"size": ("500 ml", "1 liter", "3 liter")}, (8, 55)),
        ("trail mix", "trail mix", "Grocery & Gourmet Food › Snacks › Nuts & Seeds › Trail Mix",
         ("no added salt", "resealable bag", "vegan snack", "dried fruit", "roasted nuts", "healthy snack", "peanut free", "bulk size"),
         {"flavor": ("classic", "tropical", "chocolate", "honey"), "size": _PACKS}, (6, 40)),
    ],
}
# fmt: on
CATEGORIES = tuple(sorted(PRODUCT_TYPES))

_DESCRIPTORS = ("Premium", "Classic", "Ultra", "Essential", "Deluxe", "Everyday", "Pro", "Original")
_TEMPLATES = (
    "i am looking for {attrs} {noun}",
    "i need {attrs} {noun}",
    "find me {attrs} {noun}",
    "i want to buy {attrs} {noun}",
    "please find {attrs} {noun}",
)
MAX_SHORT_ID_PRODUCTS = 5000  # 4-digit ids: keep the id space at least half empty
_BLURBS = ("for everyday use", "built to last", "tested for quality", "a customer favorite", "great value")


@dataclass(frozen=True)
class Catalog:
    """Products by ASIN, instructions by category, split bounds, and the search index."""

    seed: int
    products: dict[str, Product]
    goals: dict[str, list[Goal]]  # category -> instructions, train then dev then test
    bounds: dict[str, tuple[int, int]]  # category -> (train_end, dev_end)
    index: BM25Index

    def split_range(self, category: str, split: str) -> range:
        """Variations of ``category`` in ``split``."""
        train_end, dev_end = self.bounds[category]
        n = len(self.goals[category])
        return {"train": range(train_end), "dev": range(train_end, dev_end), "test": range(dev_end, n)}[split]

    def goal(self, category: str, variation: int) -> Goal:
        return self.goals[category][variation]


def _brands(rng: random.Random, n: int) -> list[str]:
    syllables = (
        "lu",
        "no",
        "ra",
        "vi",
        "ka",
        "te",
        "mo",
        "zen",
        "dor",
        "bel",
        "ta",
        "ri",
        "qua",
        "sol",
        "ve",
    )
    names: set[str] = set()
    while len(names) < n:
        names.add("".join(rng.choice(syllables) for _ in range(rng.randint(2, 3))).capitalize())
    return sorted(names)


def _join_attrs(attrs: list[str]) -> str:
    return attrs[0] if len(attrs) == 1 else ", ".join(attrs[:-1]) + " and " + attrs[-1]


def _price_upper(rng: random.Random, price: float) -> float:
    candidates = [p for p in PRICE_RANGE if p > price][:4]
    if len(candidates) < 2:
        return 1_000_000.0
    return sorted(rng.sample(candidates, 2))[1]


def _make_product(
    rng: random.Random,
    category: str,
    spec: tuple,
    brand: str,
    asins: set[str],
    short_ids: random.Random | None = None,
) -> Product:
    noun, query, path, pool, option_pools, (lo, hi) = spec
    while (asin := "B0" + "".join(rng.choices(string.ascii_uppercase + string.digits, k=8))) in asins:
        pass
    if short_ids is not None:
        # The same draws as an ASIN (the rest of the catalogue is unchanged), then a short digit id from a
        # separate generator: "B0" + 4 digits, the same tokens whether shown ("B01234") or clicked ("b01234").
        while (asin := f"B0{short_ids.randrange(10_000):04d}") in asins:
            pass
    asins.add(asin)
    attrs = tuple(rng.sample(pool, 3))
    options = {
        name: tuple(sorted(rng.sample(values, rng.randint(2, min(4, len(values)))), key=values.index))
        for name, values in sorted(option_pools.items())
    }
    title_words = [brand, rng.choice(_DESCRIPTORS), *noun.title().split()]
    title = " ".join(title_words) + ", " + attrs[0].title()
    bullets = tuple(f"{a.capitalize()}: {rng.choice(_BLURBS)}" for a in attrs)
    reviews = tuple(
        (
            rng.choice(("Great buy", "As described", "Works well", "Decent")),
            str(rng.randint(3, 5)),
            f"Happy with this {noun}.",
        )
        for _ in range(rng.randint(0, 2))
    )
    return Product(
        asin=asin,
        title=title,
        category=category,
        query=query,
        product_category=path,
        attributes=attrs,
        bullet_points=bullets,
        description=f"The {brand} {noun} is {_join_attrs(list(attrs))}.",
        options=options,
        price=rng.randint(lo, hi) + 0.99,
        title_nouns=(brand.lower(), *noun.split()),
        rating=f"{rng.uniform(3.0, 5.0):.1f}" if reviews else "N.A.",
        reviews=reviews,
    )


def _make_goal(rng: random.Random, product: Product, seen: set[str]) -> Goal | None:
    """An instruction for ``product`` whose text is not in ``seen`` (None after 20 tries)."""
    noun = next(spec[0] for spec in PRODUCT_TYPES[product.category] if spec[1] == product.query)
    for _ in range(20):
        attrs = sorted(rng.sample(product.attributes, rng.randint(1, 3)), key=product.attributes.index)
        goal_options = {name: rng.choice(values) for name, values in sorted(product.options.items())}
        text = rng.choice(_TEMPLATES).format(attrs=_join_attrs(attrs), noun=noun)
        if goal_options:
            text += " with " + ", and ".join(f"{k}: {v}" for k, v in goal_options.items())
        price_upper = _price_upper(rng, product.price)
        if price_upper < 1_000_000:
            text += f", and price lower than {price_upper:.2f} dollars"
        if text not in seen:
            break
    else:
        return None
    seen.add(text)
    return Goal(
        asin=product.asin,
        instruction_text=text,
        category=product.category,
        query=product.query,
        name=product.title,
        name_nouns=product.title_nouns,
        product_category=product.product_category,
        attributes=tuple(attrs),
        goal_options=goal_options,
        price_upper=price_upper,
    )


@functools.lru_cache(maxsize=4)
def build_catalog(seed: int = 0, num_products: int = 3000, ids: str = "asin") -> Catalog:
    """Generate the catalogue, its instructions and its search index (~0.5 s for 3,000 products).

    ``ids``: ``"asin"`` (WebShop's form, ``B0`` + 8 letters and digits) or ``"short"`` (``B0`` + 4 digits,
    for small models that cannot learn to copy a mixed-case id; the same products and instructions).

    Raises:
        ValueError: fewer than 10 products per category (the splits would be empty); ``ids="short"``
            with more than 5,000 products; an unknown ``ids``.
    """
    if num_products < 10 * len(CATEGORIES):
        raise ValueError(f"products={num_products}: need at least {10 * len(CATEGORIES)}")
    if ids not in ("asin", "short"):
        raise ValueError(f"ids={ids!r}: expected 'asin' or 'short'")
    if ids == "short" and num_products > MAX_SHORT_ID_PRODUCTS:
        raise ValueError(
            f"products={num_products}: at most {MAX_SHORT_ID_PRODUCTS} with ids=short (4-digit ids)"
        )
    rng = random.Random(seed)
    short_ids = random.Random(f"short-ids-{seed}") if ids == "short" else None
    brands = _brands(rng, 60)
    asins: set[str] = set()
    products: dict[str, Product] = {}
    goals: dict[str, list[Goal]] = {}
    bounds: dict[str, tuple[int, int]] = {}
    per_category = num_products // len(CATEGORIES)
    seen: set[str] = set()  # instruction texts: each is used once
    for category in CATEGORIES:
        made = [
            _make_product(
                rng,
                category,
                PRODUCT_TYPES[category][i % len(PRODUCT_TYPES[category])],
                rng.choice(brands),
                asins,
                short_ids,
            )
            for i in range(per_category)
        ]
        rng.shuffle(made)
        products.update((p.asin, p) for p in made)
        goals[category] = [g for g in (_make_goal(rng, p, seen) for p in made) if g is not None]
        train_end = int(len(goals[category]) * _SPLIT_FRACTIONS[0])
        bounds[category] = (train_end, train_end + int(len(goals[category]) * _SPLIT_FRACTIONS[1]))
    # Search results interleave categories like a real catalogue: index in a seeded global order.
    order = sorted(products)
    rng.shuffle(order)
    index = BM25Index(
        order,
        [
            " ".join(
                (products[a].title, products[a].query, *products[a].attributes, *products[a].bullet_points)
            )
            for a in order
        ],
    )
    n_goals = sum(len(g) for g in goals.values())
    logger.info("webshop stand-in: %d products, %d instructions (seed %d)", len(products), n_goals, seed)
    return Catalog(seed=seed, products=products, goals=goals, bounds=bounds, index=index)

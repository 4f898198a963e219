"""WebShop: the reward formula on hand-worked cases, the stand-in environment, and the HTTP client."""

from __future__ import annotations

import random
import re
from collections.abc import Iterator

import pytest

from hamo_ray.config import ConfigError, EnvConfig
from hamo_ray.envs import get_domain
from hamo_ray.envs.webshop import WebShopDomain
from hamo_ray.envs.webshop.catalog import CATEGORIES, build_catalog
from hamo_ray.envs.webshop.client import REAL_SPLITS, WebShopHttpEnv
from hamo_ray.envs.webshop.reward import Goal, Product, get_reward, normalize_color, token_set_ratio
from hamo_ray.envs.webshop.server import StandinServer, standin_task
from hamo_ray.types import TaskSpec

N_PRODUCTS = 1000


@pytest.fixture(scope="module")
def domain() -> WebShopDomain:
    return get_domain("webshop", EnvConfig(domain="webshop", webshop={"products": N_PRODUCTS}))


# ---- reward: goal.py get_reward on hand-worked cases ------------------------------------------------

SHIRT = Product(
    asin="B000000001",
    title="Lumo Classic Crew Neck T Shirt, Short Sleeve",
    category="fashion",
    query="men t shirts",
    product_category="Clothing › Men › Shirts › T Shirts",
    attributes=("short sleeve", "machine wash", "cotton blend"),
    options={"color": ("black", "navy blue"), "size": ("small", "large")},
    price=25.99,
    title_nouns=("lumo", "crew", "neck", "t", "shirt"),
)
GOAL = Goal(
    asin=SHIRT.asin,
    instruction_text="i need short sleeve and machine wash crew neck t shirt with color: navy blue, and size: large",
    category="fashion",
    query="men t shirts",
    name=SHIRT.title,
    name_nouns=SHIRT.title_nouns,
    product_category=SHIRT.product_category,
    attributes=("short sleeve", "machine wash"),
    goal_options={"color": "navy blue", "size": "large"},
    price_upper=40.0,
)


def test_token_set_ratio_matches_thefuzz_values() -> None:
    # the same values as rapidfuzz's token_set_ratio (cross-checked on all 42k pairs of the attribute pools)
    assert token_set_ratio("short sleeve", "short sleeve") == 100
    assert token_set_ratio("Machine-Wash", "machine wash") == 100
    assert token_set_ratio("machine wash", "machine washable cotton") == 74
    assert token_set_ratio("long sleeve", "short sleeve") == 71
    assert token_set_ratio("", "x") == 0
    assert normalize_color("navy blue") == "blue" and normalize_color("green stripe") == "green"


def test_reward_full_match() -> None:
    info = get_reward(SHIRT, GOAL, SHIRT.price, {"color": "navy blue", "size": "large"})
    assert info.reward == 1.0 and info.r_type == 1.0


def test_reward_partial_attributes() -> None:
    goal = GOAL.__class__(**{**GOAL.__dict__, "attributes": ("short sleeve", "fleece lined")})
    info = get_reward(SHIRT, goal, SHIRT.price, {"color": "navy blue", "size": "large"})
    assert info.num_attr_matches == 1
    assert info.reward == pytest.approx((1 + 2 + 1) / (2 + 2 + 1))


def test_reward_wrong_and_missing_options() -> None:
    # size is matched exactly: "small" != "large"; colour is fuzzy after normalisation
    info = get_reward(SHIRT, GOAL, SHIRT.price, {"color": "navy blue", "size": "small"})
    assert info.num_option_matches == 1 and info.reward == pytest.approx(4 / 5)
    info = get_reward(SHIRT, GOAL, SHIRT.price, {"color": "black"})
    assert info.num_option_matches == 0 and info.reward == pytest.approx(3 / 5)
    # "light blue" and "navy blue" both normalise to "blue": WebShop counts it as a match
    assert get_reward(SHIRT, GOAL, SHIRT.price, {"color": "light blue", "size": "large"}).reward == 1.0


def test_reward_price_too_high() -> None:
    info = get_reward(SHIRT, GOAL, 45.0, {"color": "navy blue", "size": "large"})
    assert not info.r_price and info.reward == pytest.approx(4 / 5)


def test_reward_type_factors() -> None:
    options = {"color": "navy blue", "size": "large"}
    other = dict(query="other", product_category="Home › Kitchen › Mugs")
    # title_score 1/5 = 0.2 (not > 0.2), no query or category match -> 0.5
    half = Product(**{**SHIRT.__dict__, **other, "title_nouns": ("lumo", "mug")})
    assert get_reward(half, GOAL, SHIRT.price, options).r_type == 0.5
    # the same product under its own query -> 1 despite the low title score
    assert (
        get_reward(Product(**{**half.__dict__, "query": GOAL.query}), GOAL, SHIRT.price, options).r_type
        == 1.0
    )
    # title_score 1/11 < 0.1 -> 0.1
    many = GOAL.__class__(**{**GOAL.__dict__, "name_nouns": tuple("abcdefghij") + ("lumo",)})
    assert get_reward(half, many, SHIRT.price, options).r_type == 0.1
    # no shared title noun -> 0, whatever else matches
    zero = Product(**{**SHIRT.__dict__, "title_nouns": ("mug",)})
    info = get_reward(zero, GOAL, SHIRT.price, options)
    assert info.r_type == 0.0 and info.reward == 0.0
    # a goal title without nouns -> title_score 0.2: 1 with a query match
    assert (
        get_reward(SHIRT, GOAL.__class__(**{**GOAL.__dict__, "name_nouns": ()}), 1.0, options).r_type == 1.0
    )


# ---- the stand-in environment --------------------------------------------------------------------


def test_expert_reaches_100_on_every_type(domain: WebShopDomain) -> None:
    env = domain.make_env()
    rng = random.Random(0)
    for task_type in domain.task_types():
        for split in ("train", "test"):
            tasks = domain.tasks(split, task_type)
            for task in rng.sample(tasks, 5):
                env.reset(task)
                for action in env.expert_actions():
                    result = env.step(action)
                assert result.done and result.score == 100.0, task.id


def test_search_click_buy_flow_and_bad_actions(domain: WebShopDomain) -> None:
    env = domain.make_env()
    goal, obs = env.reset(domain.tasks("dev", "grocery", limit=1)[0])
    assert obs == f"WebShop [SEP] Instruction: [SEP] {goal} [SEP] Search"
    for bad in (
        "",
        "jump",
        "click[buy now]",
        "search[]",
        "click[nothing here]",
        "x" * 10_000,
        "click[é\x00]",
    ):
        result = env.step(bad)
        assert result == type(result)(obs, 0.0, False, 0.0)
    results = env.step("search[protein bar chocolate]").observation
    assert "Page 1 (Total results: 50) [SEP] Next >" in results and "< Prev" not in results
    page2 = env.step("click[next >]").observation
    assert "Page 2 (Total results: 50) [SEP] < Prev [SEP] Next >" in page2
    asin = page2.split(" [SEP] ")[6]
    item = env.step(f"click[{asin.lower()}]").observation
    assert item.endswith("Description [SEP] Features [SEP] Reviews [SEP] Buy Now")
    product = env.catalog.products[asin]
    features = env.step("click[features]").observation
    assert features.endswith(" [SEP] ".join(product.bullet_points))
    assert env.step("click[< prev]").observation == item
    assert env.step("click[< prev]").observation == page2  # item -> its results page
    assert "Back to Search" not in env.step("click[back to search]").observation
    env.step("search[protein bar chocolate]")
    env.step(f"click[{env.catalog.index.search('protein bar chocolate')[0].lower()}]")
    bought = env.step("click[buy now]")
    assert bought.done and 0.0 <= bought.score <= 100.0 and bought.reward == bought.score
    assert bought.observation.startswith("Thank you for shopping with us!")
    after = env.step("search[anything]")
    assert after.done and after.reward == 0.0 and after.score == bought.score


def test_splits_disjoint_and_errors(domain: WebShopDomain) -> None:
    catalog = build_catalog(0, N_PRODUCTS)
    for category in CATEGORIES:
        by_split = {s: domain.tasks(s, category) for s in ("train", "dev", "test")}
        texts = {
            s: {catalog.goal(category, t.variation).instruction_text for t in ts}
            for s, ts in by_split.items()
        }
        asins = {s: {catalog.goal(category, t.variation).asin for t in ts} for s, ts in by_split.items()}
        for a, b in (("train", "dev"), ("train", "test"), ("dev", "test")):
            assert not texts[a] & texts[b] and not asins[a] & asins[b]
        assert all(len(ts) > 0 for ts in by_split.values())
    with pytest.raises(ConfigError):
        domain.tasks("test", "toys")
    with pytest.raises(ValueError):
        domain.make_env().reset(TaskSpec(domain="webshop", task="beauty", variation=0, split="test"))
    with pytest.raises(ConfigError, match="env.webshop.products"):
        get_domain("webshop", EnvConfig(webshop={"products": 20})).tasks("test", "beauty")
    with pytest.raises(ConfigError, match="env.webshop.url"):
        get_domain("webshop", EnvConfig(webshop={"backend": "http"}))


def test_catalog_deterministic_by_seed() -> None:
    a, b = build_catalog.__wrapped__(3, 200), build_catalog.__wrapped__(3, 200)
    assert a.products == b.products and a.goals == b.goals
    c = build_catalog.__wrapped__(4, 200)
    assert a.goals != c.goals


def test_attribute_pools_are_distinguishable() -> None:
    from hamo_ray.envs.webshop.catalog import PRODUCT_TYPES

    for specs in PRODUCT_TYPES.values():
        for _, _, _, pool, _, _ in specs:
            for x in pool:
                for y in pool:
                    assert x == y or (token_set_ratio(x, y) <= 85 and x not in y), (x, y)


# ---- the HTTP client against the loopback server speaking the AgentGym WebShop API ---------------


@pytest.fixture()
def server() -> Iterator[StandinServer]:
    srv = StandinServer(build_catalog(0, N_PRODUCTS))
    srv.start()
    yield srv
    srv.stop()


def test_http_client_plays_an_episode(server: StandinServer) -> None:
    domain = get_domain("webshop", EnvConfig(webshop={"backend": "http", "url": server.url}))
    assert domain.task_types() == ["all"]
    tasks = domain.tasks("test", "all", limit=3)
    assert [t.variation for t in tasks] == [0, 1, 2] and domain.tasks("train", "all", 1)[0].variation == 1500
    env = domain.make_env()
    assert isinstance(env, WebShopHttpEnv)
    goal, obs = env.reset(tasks[1])
    standin = standin_task(server.catalog, 1)
    assert standin.split == "test" and standin.task == CATEGORIES[1]
    assert goal == server.catalog.goal(standin.task, standin.variation).instruction_text
    assert obs.startswith("WebShop [SEP] Instruction:")
    assert env.valid_actions() == ["search[<keywords>]"]
    assert env.step("jump").observation == obs
    with pytest.raises(NotImplementedError, match="env.expert_source=file"):
        env.expert_actions()
    # play the stand-in's own expert plan through the client
    plan = server.expert_plan(1)
    for action in plan[:-1]:
        assert not env.step(action).done
    assert "click[buy now]" in env.valid_actions()
    result = env.step(plan[-1])
    assert result.done and result.score == 100.0 and result.reward == 100.0
    assert env.step("click[back to search]").score == 100.0
    with pytest.raises(ValueError):
        env.reset(TaskSpec(domain="webshop", task="all", variation=600, split="test"))
    env.close()
    env.close()
    assert server.envs == {}
    assert REAL_SPLITS["dev"] == range(500, 1500)


def test_standin_goals_keep_webshop_splits(server: StandinServer) -> None:
    seen = {}
    for goal in (*range(0, 20), *range(500, 520), *range(1500, 1540)):
        task = standin_task(server.catalog, goal)
        seen.setdefault(task.split, set()).add((task.task, task.variation))
        assert task.variation in server.catalog.split_range(task.task, task.split)
    assert [standin_task(server.catalog, g).split for g in (0, 499, 500, 1499, 1500, 12086)] == [
        "test", "test", "dev", "dev", "train", "train"
    ]  # fmt: skip
    assert not seen["train"] & seen["test"] and len(seen["train"]) == 40
    with pytest.raises(ValueError, match="12087"):
        standin_task(server.catalog, 12087)


def test_short_ids_keep_the_catalogue() -> None:
    """``ids="short"``: the same products and instructions, ids B0 + 4 digits, clickable in lower case."""
    asin, short = build_catalog.__wrapped__(3, 200), build_catalog.__wrapped__(3, 200, "short")
    assert all(len(a) == 10 for a in asin.products) and all(
        re.fullmatch(r"B0\d{4}", a) for a in short.products
    )
    assert len(short.products) == len(asin.products) == 200
    by_order = dict(zip(asin.products, short.products, strict=True))  # same draw order
    for a, s in by_order.items():
        assert asin.products[a].title == short.products[s].title and short.products[s].asin == s
    assert [g.instruction_text for g in asin.goals["beauty"]] == [
        g.instruction_text for g in short.goals["beauty"]
    ]
    cfg = EnvConfig(domain="webshop", webshop={"products": 200, "seed": 3, "ids": "short"})
    domain = get_domain("webshop", cfg)
    task = domain.tasks("dev", "beauty", limit=1)[0]
    env = domain.make_env()
    env.reset(task)
    actions = env.expert_actions()
    assert any(re.fullmatch(r"click\[b0\d{4}\]", a) for a in actions)
    for action in actions:
        result = env.step(action)
    assert result.done and result.score > 0
    with pytest.raises(ConfigError, match="env.webshop.products=6000"):
        get_domain("webshop", EnvConfig(webshop={"products": 6000, "ids": "short"})).tasks("test", "beauty")
    with pytest.raises(ValueError, match="ids='long'"):
        build_catalog.__wrapped__(0, 200, "long")


def test_the_cross_domain_presets_show_every_product_the_expert_clicks() -> None:
    """Cut to ``prompt.obs_max_chars``, a results page still holds the id the expert clicks next: a model
    trained on the expert must never be taught to click an id it was not shown (at 400 characters 45% were not)."""
    from hamo_ray.config import load_config
    from hamo_ray.prompting import clip

    for preset in ("tiny-cross.yaml", "learning-cross.yaml"):
        cfg = load_config(f"jobs/configs/{preset}", [])
        domain = get_domain("webshop", cfg.env)
        env = domain.make_env()
        clicks = 0
        for category in cfg.task_types("webshop"):
            for task in domain.tasks("dev", category, limit=15):
                env.reset(task)
                shown = ""
                for action in env.expert_actions():
                    if re.fullmatch(r"click\[b0\w+\]", action):
                        clicks += 1
                        assert action[6:-1].upper() in clip(shown, cfg.prompt.obs_max_chars), (preset, task)
                    shown = env.step(action).observation
        assert clicks == 15 * len(cfg.task_types("webshop"))

"""The offline WebShop stand-in environment: WebShop's pages, actions and reward over generated data.

It follows WebShop's text environment (``web_agent_site/envs/web_agent_text_env.py``, ``observation_mode=
"text"``) where it can:

- **Actions**: ``search[keywords]`` (accepted on every page, as in the real ``step``) and
  ``click[x]`` where ``x`` is a clickable of the current page, lowercased: ``back to search``,
  ``next >`` / ``< prev`` (results pages), a result's ASIN (``click[b0abc12345]``), an option value
  (``click[navy blue]``), ``description`` / ``features`` / ``reviews`` (sub pages; ``< prev`` goes back
  to the item), ``< prev`` on an item page (back to its results page), and ``buy now``. Like the real
  environment, an action it cannot apply (malformed, not clickable here, ``search[]``) changes nothing:
  the observation is the current page again, reward 0.
- **Observations**: the visible texts of the page joined by ``" [SEP] "`` (the real "simple" text mode):
  ``WebShop [SEP] Instruction: [SEP] <instruction> [SEP] Search`` on the search page; results pages
  list ``ASIN [SEP] title [SEP] $price`` 10 to a page out of the top 50 hits; item pages list the
  options, title, price, rating and the ``Description/Features/Reviews/Buy Now`` buttons.
- **Reward**: on ``buy now``, WebShop's ``get_reward`` (``reward.py``), 0-1, reported as a score 0-100;
  the episode is then done (further actions change nothing).
- **Expert**: search for the instruction's attributes and product type, page to the target product,
  click it, choose the instruction's options, buy (always 100). The plan is fixed at ``reset``.
"""

from __future__ import annotations

import json
import re

from hamo_ray.envs.base import EnvLifecycle, StepResult
from hamo_ray.envs.webshop.catalog import Catalog
from hamo_ray.envs.webshop.reward import Goal, get_reward
from hamo_ray.types import TaskSpec

SEARCH_RETURN_N = 50
PRODUCT_WINDOW = 10
SUB_PAGES = ("description", "features", "reviews")
_ACTION = re.compile(r"(.+)\[(.+)\]", re.DOTALL)


def parse_action(action: str) -> tuple[str, str | None]:
    """``"click[Buy Now]"`` -> ``("click", "buy now")`` (WebShop's ``parse_action`` + lowercasing)."""
    m = _ACTION.fullmatch(action.strip())
    if m is None:
        return action.strip(), None
    return m.group(1).strip().lower(), m.group(2).strip().lower()


class WebShopStandinEnv(EnvLifecycle):
    """One shopping session at a time over a shared generated ``Catalog``."""

    def __init__(self, catalog: Catalog) -> None:
        self.catalog = catalog
        self._goal: Goal | None = None
        self._plan: list[str] = []

    def reset(self, task: TaskSpec) -> tuple[str, str]:
        """Start a session on instruction ``task.variation`` of category ``task.task``.

        Raises:
            ValueError: unknown category, or a variation outside the task's split.
        """
        if task.task not in self.catalog.goals:
            raise ValueError(f"{task.id}: unknown webshop category {task.task!r}")
        if task.variation not in self.catalog.split_range(task.task, task.split):
            raise ValueError(f"{task.id}: variation {task.variation} is not in the {task.split} split")
        self._goal = self.catalog.goal(task.task, task.variation)
        self._page = "search"
        self._keywords = ""
        self._results: list[str] = []
        self._page_no = 1
        self._asin: str | None = None
        self._options: dict[str, str] = {}
        self._sub = ""
        self._done = False
        self._score = 0.0
        self._plan = self._expert_plan()
        return self._goal.instruction_text, self.observation

    @property
    def observation(self) -> str:
        """The current page in WebShop's simple text mode."""
        goal = self._require_goal()
        head = f"Instruction: [SEP] {goal.instruction_text}"
        if self._page == "search":
            return f"WebShop [SEP] {head} [SEP] Search"
        if self._page == "done":
            return " [SEP] ".join(
                [
                    "Thank you for shopping with us!",
                    "Your code:",
                    "None",
                    "(Paste it in your MTurk interface.)",
                    "Purchased",
                    "asin",
                    str(self._asin),
                    "options",
                    json.dumps(self._options),
                    "Your score (min 0.0, max 1.0)",
                    f"{self._score / 100:.4g}",
                ]
            )
        parts = [head, "Back to Search"]
        if self._page == "results":
            parts.append(f"Page {self._page_no} (Total results: {len(self._results)})")
            if self._page_no > 1:
                parts.append("< Prev")
            if self._page_no * PRODUCT_WINDOW < len(self._results):
                parts.append("Next >")
            for asin in self._page_asins():
                product = self.catalog.products[asin]
                parts += [asin, product.title, f"${product.price:.2f}"]
            return " [SEP] ".join(parts)
        product = self.catalog.products[self._asin]
        parts.append("< Prev")
        if self._page == "item":
            for name, values in product.options.items():
                parts += [name, *values]
            parts += [product.title, f"Price: ${product.price:.2f}", f"Rating: {product.rating}"]
            parts += ["Description", "Features", "Reviews", "Buy Now"]
        elif self._sub == "description":
            parts.append(product.description)
        elif self._sub == "features":
            parts += list(product.bullet_points)
        else:
            for title, score, body in product.reviews:
                parts += [title, score, body]
        return " [SEP] ".join(parts)

    def clickables(self) -> dict[str, str]:
        """Clickable texts of the current page (lowercased) -> what they are (button/product/option name)."""
        if self._page in ("search", "done"):
            return {}
        out = {"back to search": "button"}
        if self._page == "results":
            if self._page_no > 1:
                out["< prev"] = "button"
            if self._page_no * PRODUCT_WINDOW < len(self._results):
                out["next >"] = "button"
            out.update((asin.lower(), "product") for asin in self._page_asins())
            return out
        out["< prev"] = "button"
        if self._page == "item":
            for name, values in self.catalog.products[self._asin].options.items():
                out.update((value, name) for value in values)
            out.update((b, "button") for b in (*SUB_PAGES, "buy now"))
        return out

    def step(self, action: str) -> StepResult:
        """Apply ``action``; one it cannot apply leaves the page unchanged (reward 0)."""
        self._require_goal()
        if self._done:
            return StepResult(self.observation, 0.0, True, self._score)
        name, arg = parse_action(action)
        clickables = self.clickables()
        if name == "search" and arg:
            self._search(arg)
        elif name == "click" and arg in clickables:
            self._click(arg, clickables[arg])
        if self._done:
            return StepResult(self.observation, self._score, True, self._score)
        return StepResult(self.observation, 0.0, False, 0.0)

    def expert_actions(self) -> list[str]:
        """Search, page to the target, click it, choose the instruction's options, buy."""
        self._require_goal()
        return list(self._plan)

    def valid_actions(self) -> list[str]:
        """``click[...]`` for every clickable here; on the search page the template ``search[<keywords>]``."""
        self._require_goal()
        search = ["search[<keywords>]"] if self._page == "search" else []
        return search + [f"click[{c}]" for c in self.clickables()]

    def _close(self) -> None:
        """Nothing to release (the catalogue is shared)."""

    def _require_goal(self) -> Goal:
        if self._goal is None:
            raise RuntimeError("WebShopStandinEnv used before reset()")
        return self._goal

    def _page_asins(self) -> list[str]:
        start = (self._page_no - 1) * PRODUCT_WINDOW
        return self._results[start : start + PRODUCT_WINDOW]

    def _search(self, keywords: str) -> None:
        self._keywords = keywords
        self._results = self.catalog.index.search(keywords, k=SEARCH_RETURN_N)
        self._show_results(1)

    def _show_results(self, page_no: int) -> None:
        self._page, self._page_no = "results", page_no
        self._asin, self._options = None, {}

    def _click(self, arg: str, kind: str) -> None:
        if arg == "back to search":
            self._page, self._asin, self._options = "search", None, {}
        elif self._page == "results" and arg in ("next >", "< prev"):
            self._show_results(self._page_no + (1 if arg == "next >" else -1))
        elif kind == "product":
            self._page, self._asin = "item", arg.upper()
        elif self._page == "sub" and arg == "< prev":
            self._page = "item"
        elif self._page == "item" and arg == "< prev":
            self._show_results(self._page_no)
        elif arg in SUB_PAGES:
            self._page, self._sub = "sub", arg
        elif arg == "buy now":
            self._buy()
        else:  # an option value of this item
            self._options[kind] = arg

    def _buy(self) -> None:
        goal = self._require_goal()
        product = self.catalog.products[self._asin]
        info = get_reward(product, goal, product.price, self._options)
        self._page, self._done = "done", True
        self._score = round(100.0 * info.reward, 4)

    def _expert_plan(self) -> list[str]:
        goal = self._require_goal()
        target = self.catalog.products[goal.asin]
        noun = " ".join(w for w in target.title_nouns[1:])
        for query in (f"{' '.join(goal.attributes)} {noun}", target.title.lower().replace(",", "")):
            hits = self.catalog.index.search(query, k=SEARCH_RETURN_N)
            if goal.asin in hits:
                pages = hits.index(goal.asin) // PRODUCT_WINDOW
                clicks = [f"click[{v}]" for v in goal.goal_options.values()]
                return [
                    f"search[{query}]",
                    *["click[next >]"] * pages,
                    f"click[{goal.asin.lower()}]",
                    *clicks,
                    "click[buy now]",
                ]
        raise RuntimeError(f"webshop stand-in: target {goal.asin} not found by its own title")

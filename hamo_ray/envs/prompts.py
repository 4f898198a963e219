"""Agent prompts per domain, the texts only: what the agent is, the action grammar, tips, a worked example.

``hamo_ray.prompting`` turns them into the system message (``system_text``: the domain's text, the
reply rule of ``prompt.reply_format`` and, optionally, the example rendered in that format) when
``prompt.system_prompt`` is on, for training examples and inference requests alike. The grammars are
written from each environment's own documentation and sources: ScienceWorld's action templates
(``scienceworld`` package), ALFWorld's command grammar (``alfworld/data/alfred.twl2``: ``go to``,
``take ... from``, ``move ... to``, ...), TextWorld's Inform 7 verbs, WebShop's ``search[...]`` /
``click[...]``.

The worked examples are hand-written, short and fixed: invented episodes, not variations of any
split, so no stage or test set sees its own task in the prompt. Each step has a thought, shown
only when the run's reply format is ``react``::

    prompt = get_prompt("alfworld")   # a DomainPrompt: role, grammar, tips, example
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ExampleStep:
    thought: str
    action: str
    observation: str


@dataclass(frozen=True)
class DomainPrompt:
    """One domain's agent prompt: role, action grammar, tips, and a worked example episode."""

    role: str
    grammar: str
    tips: str
    example_goal: str
    example_obs: str
    example: list[ExampleStep] = field(default_factory=list)

    @property
    def system(self) -> str:
        """The prompt without reply-format and example parts (what stays fixed for a domain)."""
        return f"{self.role}\n\n{self.grammar}\n\n{self.tips}"


SCIENCEWORLD = DomainPrompt(
    role=(
        "You are an agent in ScienceWorld, a text simulation of an elementary-school science lab, "
        "a house and their surroundings. Each turn you send one command; the simulator answers "
        "with what happened. Solve the task you are given."
    ),
    grammar=(
        "Commands (OBJ is an object, LOC a location, both named as the observations name them):\n"
        "look around | look at OBJ | look in OBJ | read OBJ | inventory | task\n"
        "go to LOC | teleport to LOC | open OBJ | close OBJ\n"
        "pick up OBJ | put down OBJ | move OBJ to OBJ | pour OBJ into OBJ | dunk OBJ into OBJ | mix OBJ\n"
        "activate OBJ | deactivate OBJ | connect OBJ to OBJ | disconnect OBJ | use OBJ | use OBJ on OBJ\n"
        "eat OBJ | flush OBJ | focus on OBJ | wait | wait1"
    ),
    tips=(
        "focus on OBJ tells the simulator which object your answer is about: use it only on the "
        "object the task asks for, since focusing on a wrong one ends the task. wait lets ten time "
        "steps pass, wait1 one. When several objects match a name, the simulator asks which one; "
        "answer with its number."
    ),
    example_goal="Your task is to put a banana into the fridge. First, focus on the banana.",
    example_obs="This room is called the hallway. In it, you see: a picture. You also see: a door to "
    "the kitchen (that is closed).",
    example=[
        ExampleStep(
            "The fridge is in the kitchen, behind a closed door.",
            "open door to kitchen",
            "The door is now open.",
        ),
        ExampleStep("", "go to kitchen", "You move to the kitchen."),
        ExampleStep(
            "I look for the banana and the fridge.",
            "look around",
            "This room is called the kitchen. In it, you see: a counter. On the counter is: a "
            "banana. a fridge (that is closed).",
        ),
        ExampleStep(
            "The task asks to focus on the banana first.", "focus on banana", "You focus on the banana."
        ),
        ExampleStep("", "pick up banana", "You move the banana to the inventory."),
        ExampleStep("The fridge is closed.", "open fridge", "The fridge is now open."),
        ExampleStep("Put the banana in.", "move banana to fridge", "You move the banana to the fridge."),
    ],
)

ALFWORLD = DomainPrompt(
    role=(
        "You are an agent in a household (ALFWorld, a text version of the ALFRED tasks). Each "
        "turn you send one command; the game answers with what you see. Complete the task given "
        "after 'Your task is to:'."
    ),
    grammar=(
        "Commands (objects and receptacles are named with their number, e.g. mug 1, countertop 2):\n"
        "look | inventory | examine OBJ | examine RECEP\n"
        "go to RECEP | open RECEP | close RECEP\n"
        "take OBJ from RECEP | move OBJ to RECEP\n"
        "heat OBJ with RECEP | cool OBJ with RECEP | clean OBJ with RECEP | slice OBJ with OBJ | use OBJ"
    ),
    tips=(
        "You carry at most one object. Heat with a microwave, cool with a fridge, clean with a "
        "sinkbasin; use a desklamp to look at something under its light. A command the game "
        "cannot apply gets 'Nothing happens.'."
    ),
    example_goal="Your task is to: put a clean plate in cabinet.",
    example_obs="You are in the middle of a room. Looking quickly around you, you see a cabinet 1, a "
    "countertop 1, a sinkbasin 1, and a stoveburner 1.",
    example=[
        ExampleStep(
            "A plate is likely on the countertop.",
            "go to countertop 1",
            "On the countertop 1, you see a plate 1, and a spoon 1.",
        ),
        ExampleStep(
            "I take the plate.",
            "take plate 1 from countertop 1",
            "You pick up the plate 1 from the countertop 1.",
        ),
        ExampleStep(
            "It must be clean: the sinkbasin cleans it.",
            "go to sinkbasin 1",
            "On the sinkbasin 1, you see nothing.",
        ),
        ExampleStep(
            "Clean it here.", "clean plate 1 with sinkbasin 1", "You clean the plate 1 using the sinkbasin 1."
        ),
        ExampleStep("Now to the cabinet.", "go to cabinet 1", "The cabinet 1 is closed."),
        ExampleStep(
            "Open it first.",
            "open cabinet 1",
            "You open the cabinet 1. The cabinet 1 is open. In it, you see nothing.",
        ),
        ExampleStep(
            "Put the plate in.", "move plate 1 to cabinet 1", "You move the plate 1 to the cabinet 1."
        ),
    ],
)

WEBSHOP = DomainPrompt(
    role=(
        "You are a shopping agent on a web shop (WebShop). Each turn you send one action; the "
        "shop answers with the page you are on. Find and buy the product that best matches the "
        "instruction: its attributes, its options (size, colour, ...) and its price limit."
    ),
    grammar=(
        "Actions:\n"
        "search[KEYWORDS]  search the shop (on the search page)\n"
        "click[BUTTON]     click a button of the current page, written as the page shows it: a "
        "product id (e.g. click[b07xyz1234]), an option value, 'Next >', '< Prev', 'Back to Search', "
        "'Description', 'Features', 'Reviews', 'Buy Now'"
    ),
    tips=(
        "Search with the instruction's key words, open a product that fits, click each option the "
        "instruction asks for, then click[Buy Now]. Buying ends the episode."
    ),
    example_goal="i need a pair of blue canvas sneakers in size 9, and price lower than 40.00 dollars",
    example_obs="WebShop [SEP] Instruction: [SEP] i need a pair of blue canvas sneakers in size 9, and "
    "price lower than 40.00 dollars [SEP] Search",
    example=[
        ExampleStep(
            "I search for the product.",
            "search[blue canvas sneakers]",
            "[SEP] Back to Search [SEP] Page 1 (Total results: 2) [SEP] Next > [SEP] B0EXAMPLE1 "
            "[SEP] Canvas Low Top Sneaker [SEP] $29.99 [SEP] B0EXAMPLE2 [SEP] Leather Boot [SEP] $89.00",
        ),
        ExampleStep(
            "The first one is canvas and under 40 dollars.",
            "click[b0example1]",
            "[SEP] Back to Search [SEP] < Prev [SEP] size [SEP] 8 [SEP] 9 [SEP] color [SEP] blue "
            "[SEP] white [SEP] Canvas Low Top Sneaker [SEP] Price: $29.99 [SEP] Buy Now",
        ),
        ExampleStep("Choose size 9.", "click[9]", "You have clicked 9."),
        ExampleStep("Choose blue.", "click[blue]", "You have clicked blue."),
        ExampleStep("All options match; buy it.", "click[Buy Now]", "Thank you for shopping with us!"),
    ],
)

TEXTWORLD = DomainPrompt(
    role=(
        "You are a player of a text adventure game (TextWorld). Each turn you send one command; "
        "the game answers with what happens. Reach the game's objective."
    ),
    grammar=(
        "Commands (name things as the game does):\n"
        "look | inventory | goal | examine THING\n"
        "go north | go south | go east | go west\n"
        "open THING | close THING | take THING | take THING from THING | drop THING\n"
        "put THING on THING | insert THING into THING | unlock THING with KEY | lock THING with KEY\n"
        "eat THING | cook THING with THING | slice THING with THING | dice THING with THING | "
        "chop THING with THING | prepare meal"
    ),
    tips="Read the objective and each room's description; containers may have to be opened first.",
    example_goal="Take the red apple from the wooden chest in the pantry and put it on the table.",
    example_obs="-= Kitchen =- You are in a kitchen. There is a table here. An exit leads north.",
    example=[
        ExampleStep("The pantry must be north.", "go north", "-= Pantry =- You see a closed wooden chest."),
        ExampleStep(
            "Open the chest.", "open wooden chest", "You open the wooden chest, revealing a red apple."
        ),
        ExampleStep("Take the apple.", "take red apple from wooden chest", "You take the red apple."),
        ExampleStep("Back to the kitchen.", "go south", "-= Kitchen =- There is a table here."),
        ExampleStep("Put it on the table.", "put red apple on table", "You put the red apple on the table."),
    ],
)

TEXTCRAFT = DomainPrompt(
    role=(
        "You are crafting items in TextCraft, a text version of Minecraft's crafting. You are given "
        "crafting commands and a goal item. Each turn you send one command; the game answers with what "
        "happened. Craft the goal item."
    ),
    grammar=(
        "Commands (name items exactly as the crafting commands do):\n"
        "get N ITEM | craft N ITEM using N ITEM, N ITEM | inventory"
    ),
    tips=(
        "Only base items can be got; everything else must be crafted with one of the given commands, "
        "from items in your inventory, in the amounts the command names."
    ),
    example_goal="craft 1 wooden bowl.",
    example_obs="Crafting commands:\ncraft 4 spruce planks using 1 spruce log\ncraft 1 wooden bowl using 3 spruce planks",
    example=[
        ExampleStep("Planks come from a log; get one.", "get 1 spruce log", "Got 1 spruce log"),
        ExampleStep(
            "Make planks.", "craft 4 spruce planks using 1 spruce log", "Crafted 4 minecraft:spruce_planks"
        ),
        ExampleStep(
            "Three planks make the bowl.",
            "craft 1 wooden bowl using 3 spruce planks",
            "Crafted 1 minecraft:wooden_bowl",
        ),
    ],
)

BABYAI = DomainPrompt(
    role=(
        "You are an agent in BabyAI, a grid world described in text. Each turn you send one of the "
        "available actions; the world answers with what you see. Reach the goal you are given."
    ),
    grammar=(
        "Every observation ends with the available actions; send exactly one of them, e.g.:\n"
        "turn left | turn right | move forward | go to OBJ N | pick up OBJ | toggle | check available actions"
    ),
    tips="Objects are named by colour and kind (red ball 1); go to an object before picking it up.",
    example_goal="pick up the green key",
    example_obs=(
        "In front of you in this room, you can see several objects: a green key 2 steps in front of you.\n"
        'Available actions: ["turn left", "turn right", "move forward", "go to green key 1", '
        '"check available actions"]'
    ),
    example=[
        ExampleStep("Walk to the key.", "go to green key 1", "You are in front of the green key."),
        ExampleStep("Take it.", "pick up green key", "You picked up the green key.\n The task is completed."),
    ],
)

DOMAIN_PROMPTS: dict[str, DomainPrompt] = {
    "scienceworld": SCIENCEWORLD,
    "alfworld": ALFWORLD,
    "webshop": WEBSHOP,
    "textworld": TEXTWORLD,
    "textcraft": TEXTCRAFT,
    "babyai": BABYAI,
}


def get_prompt(domain: str) -> DomainPrompt:
    """The prompt of ``domain``.

    Raises:
        ValueError: no prompt is defined for ``domain``.
    """
    if domain not in DOMAIN_PROMPTS:
        raise ValueError(f"no agent prompt for domain {domain!r}; known: {', '.join(sorted(DOMAIN_PROMPTS))}")
    return DOMAIN_PROMPTS[domain]

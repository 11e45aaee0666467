"""Prompt sets for self-distillation: thousands of distinct first turns, none shared with the held-out split.

Three sources, all deterministic for a seed:
- the shipped hand-written training prompts (`data/prompts_train.jsonl`);
- templated families: task templates crossed with topic, object and number
  lists (explanations, how-tos, lists, comparisons, code, arithmetic word
  problems, rewrites, letters, stories, definitions, advice);
- the target's own instructions (Magpie style): the chat template up to the
  user's turn, sampled by the target itself (`self_instruct_prefix`), kept
  when they look like a request.

Follow-up turns ("Can you give an example?") are added by the data stage on
top of answered first turns, so multi-turn contexts come from the target too.

`heldout_filter` removes every candidate that shares a normalised 5-word
shingle with a held-out prompt (or equals one), so the held-out split shares
no text with training.
"""

from __future__ import annotations

import itertools
import random
import re

TOPICS = """photosynthesis|black holes|the water cycle|volcanoes|earthquakes|tides|rainbows|the immune system|vaccines|
antibiotics|DNA|evolution|plate tectonics|the greenhouse effect|climate change|solar panels|wind turbines|nuclear power|
batteries|electric cars|the internet|Wi-Fi|GPS|blockchain|machine learning|neural networks|compilers|operating systems|
databases|encryption|passwords|cloud computing|the stock market|inflation|interest rates|credit scores|mortgages|
compound interest|supply and demand|taxes|the Roman Empire|the French Revolution|the Renaissance|the Industrial Revolution|
ancient Egypt|the Silk Road|the printing press|the Cold War|the Moon landing|the Olympic Games|jazz|the violin|
impressionism|Shakespeare|haiku|chess|soccer|marathon training|yoga|meditation|sleep|caffeine|hydration|vitamins|
protein|sourdough bread|composting|houseplants|bees|octopuses|dolphins|elephants|migrating birds|coral reefs|rainforests|
deserts|glaciers|the Sahara|the Amazon river|Mount Everest|the Moon|Mars|Jupiter|comets|the Sun|gravity|magnets|
electricity|sound waves|light|friction|rockets|airplanes|submarines|bridges|skyscrapers|concrete|glass|paper|
recycling|plastic pollution|public libraries|museums|time zones|calendars|leap years|maps|languages|grammar|
public speaking|job interviews|remote work|time management|budgeting|saving money|first aid|fire safety|camping|
hiking|gardening|baking|coffee|tea|chocolate|cheese|fermentation|spices|pasta|rice|bicycles|trains|traffic lights|
elevators|refrigerators|microwaves|3D printing|smartphones|touchscreens|cameras|telescopes|microscopes|thermometers|
clocks|the human heart|the brain|memory|habits|motivation|stress|friendship|teamwork|negotiation|leadership|
volunteering|learning a language|learning to code|open source software|version control|unit testing|spreadsheets|
email etiquette|online privacy|social media|video games|podcasts|photography|drawing|knitting|woodworking|pottery""".replace(
    "\n", ""
).split("|")

EXPLAIN = [
    "Explain {t} in simple terms.",
    "How does {t} work?",
    "Give me a short introduction to {t}.",
    "What are the most important things to know about {t}?",
    "Explain {t} to a ten-year-old.",
    "Why does {t} matter?",
    "What is a common misconception about {t}?",
    "Write three short paragraphs about {t}.",
    "Summarize the history of {t} in a few sentences.",
    "What are the pros and cons of {t}?",
    "List five interesting facts about {t}.",
    "Write a short quiz with three questions about {t}, with answers.",
    "Describe {t} in one paragraph for a school report.",
    "What questions do beginners usually ask about {t}? Answer two of them.",
    "Give me a simple analogy that explains {t}.",
    "Write a haiku about {t}.",
    "Write a short poem about {t}.",
    "Write a tweet-length fact about {t}.",
    "Tell me a short story that involves {t}.",
    "What careers are related to {t}?",
]

PAIRS = [
    ("cats", "dogs"),
    ("tea", "coffee"),
    ("Python", "JavaScript"),
    ("renting", "buying a home"),
    ("trains", "planes"),
    ("e-books", "paper books"),
    ("running", "swimming"),
    ("SQL", "NoSQL databases"),
    ("Linux", "Windows"),
    ("solar power", "wind power"),
    ("city life", "country life"),
    ("working from home", "working in an office"),
    ("lists", "tuples in Python"),
    ("stocks", "bonds"),
    ("baking", "frying"),
    ("violin", "piano"),
    ("Mars", "Venus"),
    ("credit cards", "debit cards"),
    ("laptops", "desktop computers"),
    ("git merge", "git rebase"),
    ("TCP", "UDP"),
    ("mountains", "beaches for a holiday"),
    ("walking", "cycling to work"),
    ("HTTP", "HTTPS"),
    ("viruses", "bacteria"),
    ("weather", "climate"),
    ("a Roth IRA", "a traditional IRA"),
    ("ants", "termites"),
]
COMPARE = [
    "Compare {a} and {b}.",
    "What is the difference between {a} and {b}?",
    "Should I choose {a} or {b}? Weigh them up.",
    "Give me a short table comparing {a} and {b}.",
    "{a} or {b}: which is better for a beginner?",
]

HOWTO_TASKS = """make a cup of tea|change a flat bicycle tire|start a vegetable garden|write a good resume|prepare for a job interview|
clean a laptop keyboard|learn to juggle|plan a road trip|make pancakes|fold a paper airplane|set up a home aquarium|
back up my phone|speed up a slow computer|tie a tie|brew coffee with a French press|train for a 5k run|
organize my closet|write a cover letter|care for a cactus|make a budget spreadsheet|reduce food waste at home|
improve my handwriting|study for an exam|make friends in a new city|fall asleep faster|start journaling|
paint a room|make homemade pizza|teach a dog to sit|remove a coffee stain|write a thank-you note|
save for a vacation|set up a Python virtual environment|learn touch typing|keep houseplants alive|
prepare an emergency kit|hang a picture straight|cook rice on the stove|give a short presentation|
be more productive in the morning|start running at age forty|learn chess openings|make cold brew coffee""".replace(
    "\n", ""
).split("|")
HOWTO = [
    "How do I {h}?",
    "What are the steps to {h}?",
    "Give me a step-by-step guide to {h}.",
    "Any tips on how to {h}?",
    "I have never tried to {h}. Where should I start?",
    "What mistakes should I avoid when I {h}?",
]

LISTS = """fruits that are high in vitamin C|board games for a family night|books for someone learning to cook|
ways to save energy at home|hobbies that cost very little|exercises you can do without equipment|
programming languages for beginners|countries in South America|rivers in Europe|planets in the solar system|
famous painters|musical instruments from Africa|healthy breakfast ideas|indoor activities for a rainy day|
questions to ask in a job interview|ways to reduce stress|animals that live in the Arctic|uses for baking soda|
things to pack for a beach trip|kitchen tools every cook needs|tips for a long flight|ideas for a birthday party|
names for a pet goldfish|ways to practice a new language|classic science fiction novels|herbs to grow on a windowsill|
reasons to learn history|safety tips for cycling in a city|common Python mistakes|good habits for programmers""".replace(
    "\n", ""
).split("|")
LIST_TEMPLATES = [
    "List {n} {x}.",
    "Name {n} {x}.",
    "Give me {n} {x}, with one sentence each.",
    "What are {n} good {x}?",
]

CODE_TASKS = """reverse a string|check whether a number is prime|compute the factorial of n|find the largest item in a list|
count the words in a sentence|remove duplicates from a list|merge two sorted lists|compute Fibonacci numbers|
check whether a string is a palindrome|flatten a nested list|sort a list of dictionaries by a key|
read a CSV file and print each row|count how often each letter appears in a text|convert Celsius to Fahrenheit|
find the second largest number in a list|capitalize every word in a sentence|compute the average of a list|
check whether two strings are anagrams|generate a random password|implement binary search|implement bubble sort|
implement a stack class|implement a queue with two stacks|find the greatest common divisor of two numbers|
convert a number to binary|sum the digits of a number|transpose a matrix|find all even numbers in a list|
parse a date string|count the lines in a file|validate an email address with a regular expression|
group words by their first letter|rotate a list by k positions|find the missing number in 1..n|
compute the running total of a list|check for balanced parentheses|implement FizzBuzz|
compute the dot product of two vectors|split a list into chunks of size n|find the most common element in a list""".replace(
    "\n", ""
).split("|")
LANGS = ["Python", "Python", "Python", "JavaScript", "Java", "C", "Go", "Rust", "Bash", "SQL"]
CODE = [
    "Write a {l} function to {c}.",
    "How do I {c} in {l}?",
    "Show me {l} code that will {c}, and explain it.",
    "Write a short {l} program to {c}.",
    "What is the simplest way to {c} in {l}?",
]

NAMES = [
    "Anna",
    "Ben",
    "Carlos",
    "Dina",
    "Eli",
    "Fatima",
    "George",
    "Hana",
    "Ivan",
    "Julia",
    "Kofi",
    "Lena",
    "Maya",
    "Noah",
]
ITEMS = ["apples", "pencils", "stickers", "books", "cookies", "marbles", "tickets", "cupcakes", "stamps", "oranges"]
MATH = [
    "{p} has {a} {i} and buys {b} more. How many {i} does {p} have now?",
    "{p} has {a} {i} and gives away {b}. How many are left?",
    "A box holds {b} {i}. How many boxes are needed for {a} {i}?",
    "{p} reads {b} pages a day. How many days to finish a {a}-page book?",
    "What is {a} times {b}?",
    "What is {a} plus {b}, and what is {a} minus {b}?",
    "A shirt costs ${a} and is {b}% off. What is the sale price?",
    "{p} walks {b} km a day. How far in {a} days?",
    "If a train travels {a} km in {b} hours, what is its average speed?",
    "{p} saves ${b} every week. How many weeks to save ${a}?",
    "What is {b}% of {a}?",
    "A rectangle is {a} cm long and {b} cm wide. What are its area and perimeter?",
]

REWRITE_TEXTS = [
    "the meeting is moved to friday because the boss is sick",
    "i cant come to the party sorry i have to work",
    "Our product is good. It is cheap. People like it. Buy it now.",
    "the printer on floor 2 is broken again pls fix",
    "We regret to inform you that your order has been delayed due to unforeseen circumstances.",
    "The weather was bad so the game was cancelled and everyone went home early.",
    "hey can u send me the notes from class today",
    "The new park has a playground, a pond and lots of trees. It opens on Monday.",
    "Thanks for the gift, I really like it a lot, it was very nice of you.",
    "Please be advised that the office will be closed for the holiday.",
]
REWRITE = [
    'Make this more formal: "{r}"',
    'Rewrite this in a friendly tone: "{r}"',
    'Fix the grammar: "{r}"',
    'Make this shorter: "{r}"',
    'Rewrite this for a ten-year-old: "{r}"',
    'Turn this into a polite email: "{r}"',
]

LETTERS = """my landlord about a leaking tap|a friend who just moved abroad|my team about a project delay|
a teacher thanking them for a great year|a neighbor about a noisy dog|a company asking about a job opening|
my manager asking for a day off|a customer apologizing for a late delivery|a hotel asking to change a booking|
my grandmother about my first week at university""".replace("\n", "").split("|")
LETTER_TEMPLATES = ["Write a short email to {w}.", "Draft a polite note to {w}.", "Write a message to {w}."]

STORY_SUBJECTS = """a robot who learns to paint|a lost kitten in a big city|a lighthouse keeper|a dragon who is afraid of fire|
two friends on a camping trip|a time traveler at a market|a shy student on the first day of school|a talking tree|
a chef who loses their sense of taste|a detective solving a missing-sock mystery|a girl who builds a rocket|
an old sailor and a storm|a village without music|a penguin who wants to fly""".replace("\n", "").split("|")
STORY = [
    "Write a short story about {s}.",
    "Tell me a bedtime story about {s}.",
    "Write a poem about {s}.",
    "Write the opening paragraph of a novel about {s}.",
]

WORDS = """algorithm|bandwidth|biodiversity|empathy|entropy|inflation|metaphor|photosynthesis|democracy|irony|
recursion|latency|mitochondria|nostalgia|paradox|placebo|resilience|sustainability|syntax|velocity|API|
firewall|ecosystem|hypothesis|catalyst|renaissance|algorithmic bias|opportunity cost|sunk cost|procrastination""".replace(
    "\n", ""
).split("|")
DEFINE = ["What does '{w}' mean?", "Define {w} and give an example.", "How would you explain the word '{w}'?"]

ADVICE = """I feel nervous before exams|I can't stop checking my phone|my roommate never cleans up|I want to eat healthier|
I keep forgetting people's names|I have too many tabs open at work|I want to read more books|I am bored at my job|
my plants keep dying|I want to get better at math|I get tired every afternoon|I want to start exercising""".replace(
    "\n", ""
).split("|")
ADVICE_TEMPLATES = ["{v}. What should I do?", "{v}. Any advice?", "Help: {v}."]

FOLLOW_UPS = [
    "Can you give an example?",
    "Explain that more simply.",
    "Summarize that in one sentence.",
    "Why is that?",
    "Can you make it shorter?",
    "Tell me more about the first point.",
    "What would you add to that?",
    "Thanks! Can you put that in a list?",
    "Is there anything I should be careful about?",
    "How would you say that to a child?",
]

SMOLLM_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def templated_prompts(rng: random.Random) -> list[dict]:
    out: list[dict] = []
    for t, tmpl in itertools.product(TOPICS, EXPLAIN):
        out.append({"prompt": tmpl.format(t=t), "kind": "explain"})
    for (a, b), tmpl in itertools.product(PAIRS, COMPARE):
        out.append({"prompt": tmpl.format(a=a, b=b), "kind": "compare"})
    for h, tmpl in itertools.product(HOWTO_TASKS, HOWTO):
        out.append({"prompt": tmpl.format(h=h), "kind": "howto"})
    for x, tmpl in itertools.product(LISTS, LIST_TEMPLATES):
        out.append({"prompt": tmpl.format(x=x, n=rng.choice([3, 4, 5, 6, 7, 10])), "kind": "list"})
    for c, tmpl, lang in itertools.product(CODE_TASKS, CODE, sorted(set(LANGS))):
        if rng.random() < 0.35 or lang == "Python":
            out.append({"prompt": tmpl.format(c=c, l=lang), "kind": "code"})
    for tmpl in MATH:
        for _ in range(40):
            a, b = rng.randint(12, 480), rng.randint(2, 60)
            out.append({"prompt": tmpl.format(p=rng.choice(NAMES), i=rng.choice(ITEMS), a=a, b=b), "kind": "math"})
    for r, tmpl in itertools.product(REWRITE_TEXTS, REWRITE):
        out.append({"prompt": tmpl.format(r=r), "kind": "rewrite"})
    for w, tmpl in itertools.product(LETTERS, LETTER_TEMPLATES):
        out.append({"prompt": tmpl.format(w=w), "kind": "email"})
    for s, tmpl in itertools.product(STORY_SUBJECTS, STORY):
        out.append({"prompt": tmpl.format(s=s), "kind": "story"})
    for w, tmpl in itertools.product(WORDS, DEFINE):
        out.append({"prompt": tmpl.format(w=w), "kind": "define"})
    for v, tmpl in itertools.product(ADVICE, ADVICE_TEMPLATES):
        out.append({"prompt": tmpl.format(v=v), "kind": "advice"})
    return out


def normalise(text: str) -> str:
    return " ".join(re.findall(r"[a-z0-9]+", text.lower()))


def shingles(text: str, n: int = 5) -> set[str]:
    words = normalise(text).split()
    if len(words) < n:
        return {" ".join(words)}
    return {" ".join(words[i : i + n]) for i in range(len(words) - n + 1)}


def heldout_filter(heldout: list[str]):
    """A predicate that is False for any prompt sharing a 5-word shingle with (or equal to) a held-out prompt."""
    banned = set().union(*(shingles(p) for p in heldout)) if heldout else set()
    exact = {normalise(p) for p in heldout}
    return lambda prompt: normalise(prompt) not in exact and not (shingles(prompt) & banned)


def dedupe(items: list[dict]) -> list[dict]:
    seen, out = set(), []
    for item in items:
        key = normalise(item["prompt"])
        if key and key not in seen:
            seen.add(key)
            out.append(item)
    return out


def is_instruction(text: str) -> bool:
    """Keep a self-written instruction when it is a plausible, complete user request."""
    words = text.split()
    return 4 <= len(words) <= 80 and not text.lower().startswith(("assistant", "user", "system")) and "<|" not in text


def build_prompt_set(
    base: list[dict], heldout: list[str], *, seed: int = 0, self_instruct: list[str] = ()
) -> list[dict]:
    """Shipped + templated + self-instructed prompts, deduplicated, shuffled, with held-out overlap removed."""
    rng = random.Random(seed)
    items = list(base) + templated_prompts(rng) + self_instructed(self_instruct)
    keep = heldout_filter(heldout)
    items = [it for it in dedupe(items) if keep(it["prompt"])]
    rng.shuffle(items)
    return items


def more_self_instructed(existing: list[str], self_instruct: list[str], heldout: list[str]) -> list[dict]:
    """The self-written prompts a frozen prompt list grows by: those `build_prompt_set` would keep that the list
    does not hold yet, in the order written (so growing twice to the same count appends nothing)."""
    keep, have = heldout_filter(heldout), {normalise(p) for p in existing}
    return [
        it
        for it in dedupe(self_instructed(self_instruct))
        if normalise(it["prompt"]) not in have and keep(it["prompt"])
    ]


def self_instructed(texts: list[str]) -> list[dict]:
    """The target's own requests that look like one (`is_instruction`), as prompt-set items."""
    return [{"prompt": p, "kind": "self"} for p in texts if is_instruction(p)]

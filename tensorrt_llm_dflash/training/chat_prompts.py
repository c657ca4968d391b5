"""The chat part of the built-in self-distillation set: conversations a chat assistant gets.

The embedded target is a chat model, and a drafter only predicts well what it was trained
on, so the built-in set mixes code with everyday conversation: explanations, how-tos,
advice, comparisons, stories, poems, lists, emails, summaries and rewrites of a given
paragraph, and short multi-turn exchanges (a follow-up on the assistant's own answer).

Everything is generated here from templates crossed with topic lists (many phrasings per
kind), written for this project. The paragraphs to summarise or rewrite are everyday texts
(news items, reviews, diary entries, notes from work, notices, science snippets) composed
from frames and slot lists, and some prose docstrings of the Python standard library, so
nothing is downloaded. The target answers every turn itself (self-distillation): the
drafter learns the target's own chat distribution, not a dataset's.

A conversation is a tuple of user turns; the target's answers go between them.
"""

from __future__ import annotations

import importlib
import inspect
import random
import re
import sys
import warnings

# ------------------------------------------------------------------ topic lists

SCIENCE = [
    "photosynthesis", "gravity", "the water cycle", "black holes", "plate tectonics", "evolution by natural selection",
    "the immune system", "how the heart pumps blood", "electricity", "magnetism", "the speed of light", "atoms",
    "chemical reactions", "the seasons", "the phases of the moon", "ocean tides", "volcanoes", "earthquakes",
    "rainbows", "clouds", "the greenhouse effect", "climate change", "renewable energy", "nuclear fusion",
    "antibiotics", "vaccines", "sleep", "memory", "the human brain", "digestion", "DNA", "genes", "bacteria",
    "viruses", "the food chain", "pollination", "bird migration", "fossils", "the Big Bang", "stars", "the Sun",
    "the solar system", "Mars", "friction", "sound waves", "temperature and heat", "erosion", "coral reefs",
    "rainforests", "deserts", "the ozone layer", "static electricity", "batteries", "magnets", "lightning",
]
SOCIETY = [
    "inflation", "interest rates", "compound interest", "a budget", "taxes", "supply and demand", "the stock market",
    "credit scores", "insurance", "a mortgage", "democracy", "the United Nations", "the Industrial Revolution",
    "the Renaissance", "the Roman Empire", "ancient Egypt", "the printing press", "the Silk Road", "the Cold War",
    "the French Revolution", "world trade", "globalization", "minimum wage", "unemployment", "recycling",
    "urban planning", "public transport", "the Olympic Games", "human rights", "voting", "cryptocurrency",
    "a pension plan", "the scientific method", "critical thinking", "philosophy", "ethics", "mindfulness",
]
TECH = [
    "the internet", "Wi-Fi", "cloud computing", "artificial intelligence", "machine learning", "a search engine",
    "email", "a computer's memory", "a CPU", "a smartphone camera", "GPS", "encryption", "passwords",
    "two-factor authentication", "a web browser", "social media algorithms", "3D printing", "electric cars",
    "solar panels", "a microwave oven", "a refrigerator", "noise-cancelling headphones", "QR codes", "Bluetooth",
    "a computer virus", "open-source software", "a database", "a spreadsheet", "video streaming", "robots",
]
EVERYDAY = [
    "learning a new language", "saving money", "cooking at home", "sleeping better", "staying focused",
    "public speaking", "working from home", "exercising regularly", "eating healthier", "reading more books",
    "making friends in a new city", "preparing for a job interview", "writing a resume", "managing stress",
    "keeping a plant alive", "training a puppy", "planning a trip", "packing light", "staying hydrated",
    "organizing a small apartment", "studying for exams", "learning to draw", "starting a garden",
    "running a first 5k", "waking up early", "reducing screen time", "negotiating a salary", "moving house",
    "hosting a dinner party", "taking better photos", "learning to swim", "keeping a journal", "meal planning",
    "decluttering", "caring for an elderly parent", "teaching a child to read", "learning to play guitar",
]
HOW_TO = [
    "boil an egg", "make a cup of tea", "change a flat tire", "tie a tie", "write a thank-you note",
    "start a vegetable garden", "make bread at home", "clean a cast iron pan", "fold a fitted sheet",
    "plan a weekly budget", "set up a home Wi-Fi network", "back up my photos", "make a good first impression",
    "write a cover letter", "prepare for a marathon", "learn to meditate", "cook rice on the stove",
    "remove a coffee stain", "save for a holiday", "make a paper airplane", "brew coffee with a French press",
    "keep houseplants healthy", "introduce two cats", "choose a good watermelon", "sharpen a kitchen knife",
    "write a short speech for a wedding", "memorize a poem", "organize my email inbox", "stop procrastinating",
    "make a simple tomato sauce", "pick a good password", "read a nutrition label", "calm down before an exam",
    "make homemade pizza", "learn touch typing", "prepare a room for painting", "give constructive feedback",
    "ask for a raise", "plan a birthday party", "build a campfire safely", "store fresh herbs",
]
SITUATIONS = [
    "just started a new job and feel overwhelmed", "can't sleep before important days",
    "want to get fit but have no time", "keep forgetting people's names", "have a difficult coworker",
    "am nervous about a presentation tomorrow", "want to change careers at forty", "spend too much money online",
    "find it hard to say no to people", "am moving to a country where I don't speak the language",
    "have a friend who always cancels plans", "feel lonely after moving to a new city",
    "want to learn programming but don't know where to start", "have too many things on my to-do list",
    "get distracted by my phone all the time", "want to eat less sugar", "am planning my first solo trip",
    "have a job interview next week", "argued with my sister and want to make up", "want to read more but never do",
    "am starting university in the autumn", "have a noisy neighbour", "want to run a half marathon",
    "am a new manager of a small team", "keep putting off going to the dentist",
]
COMPARE = [
    ("a cat", "a dog", "a small apartment"), ("tea", "coffee", "the morning"), ("renting", "buying a home", "a young family"),
    ("a laptop", "a tablet", "a student"), ("running", "swimming", "staying fit"), ("trains", "planes", "travel in Europe"),
    ("e-books", "paper books", "reading before bed"), ("a savings account", "index funds", "long-term savings"),
    ("electric cars", "petrol cars", "city driving"), ("weather", "climate", None), ("a virus", "a bacterium", None),
    ("stocks", "bonds", "a retirement plan"), ("yoga", "pilates", "back pain"), ("baking", "frying", "healthy cooking"),
    ("a credit card", "a debit card", "everyday spending"), ("solar power", "wind power", "a small village"),
    ("Python", "JavaScript", "a first programming language"), ("a hotel", "a hostel", "a backpacking trip"),
    ("a novel", "a short story", "a beginner writer"), ("working from home", "working in an office", "a new employee"),
    ("a lake", "a sea", None), ("mitosis", "meiosis", None), ("speed", "velocity", None),
    ("email", "instant messaging", "a team at work"), ("cash", "contactless payment", "a market stall"),
]
STORY_HEROES = [
    "a lonely robot", "a brave little mouse", "an old lighthouse keeper", "a girl who can talk to birds",
    "a dragon who is afraid of fire", "a detective cat", "a boy who finds a map", "a grandmother who becomes a pilot",
    "a snowman in summer", "a shy giant", "a baker in a tiny village", "two friends on a sailing boat",
    "a time traveller who loses her watch", "a tree that wants to walk", "an astronaut on her first mission",
    "a fox and a crow", "a student on the first day of school", "a musician who lost his voice", "a clumsy wizard",
    "a dog waiting at a train station", "a penguin who wants to fly", "a lost umbrella", "a chess-playing parrot",
]
STORY_EVENTS = [
    "finds a secret door", "learns to be patient", "makes an unexpected friend", "saves the town from a flood",
    "has to keep a promise", "gets lost in a forest", "discovers a hidden talent", "wins a strange contest",
    "travels to the moon", "solves a mystery", "returns home after many years", "has one day to fix a mistake",
]
POEM_FORMS = ["a short poem", "a haiku", "a limerick", "a four-line poem", "a rhyming poem", "a free-verse poem",
              "an acrostic poem", "a poem for children"]
POEM_SUBJECTS = [
    "the ocean", "autumn leaves", "a rainy morning", "the moon", "friendship", "a city at night", "mountains",
    "a cup of coffee", "the first snow", "a cat sleeping in the sun", "spring flowers", "an old bicycle",
    "summer holidays", "the stars", "a quiet library", "a thunderstorm", "home", "growing older", "a garden",
    "the sea at dawn", "a long train journey", "Monday mornings", "a lighthouse", "the wind",
]
LIST_ITEMS = [
    "healthy breakfast ideas", "fun things to do on a rainy day", "books every teenager should read",
    "ways to reduce plastic waste", "cheap date ideas", "good habits for a productive morning",
    "questions to ask at the end of a job interview", "easy houseplants for beginners",
    "interesting facts about octopuses", "things to pack for a beach holiday", "hobbies you can start at home",
    "ways to save energy at home", "famous inventions of the 20th century", "tips for a long flight",
    "board games for a family evening", "foods rich in protein", "ways to be kinder to yourself",
    "facts about the planet Jupiter", "classic films worth watching", "skills every adult should learn",
    "reasons to learn history", "ideas for a small birthday gift", "ways to make a team meeting shorter",
]
EMAIL_TASKS = [
    ("a polite", "my landlord", "a broken heater"), ("a friendly", "a new neighbour", "inviting them for coffee"),
    ("a formal", "a hiring manager", "following up after an interview"), ("a short", "my team", "a meeting moved to Friday"),
    ("an apologetic", "a customer", "a late delivery"), ("a warm", "an old teacher", "thanking them"),
    ("a professional", "a client", "a project delay"), ("a polite", "a colleague", "asking for a code review"),
    ("a cheerful", "my family", "our holiday plans"), ("a clear", "the school", "my child missing a day"),
    ("a firm but polite", "a company", "a refund that never arrived"), ("a short", "my manager", "taking a day off"),
]
FOLLOW_UPS = [
    "Can you make that shorter?", "Thanks! Can you give me an example?", "Can you explain that more simply?",
    "What would you do first?", "Can you turn that into a numbered list?", "Why is that?",
    "Can you say more about the second point?", "Great, and what are the most common mistakes?",
    "Could you write it in a more formal tone?", "Can you summarize that in one sentence?",
    "How long would that take?", "What if I only have ten minutes a day?", "Thank you, that helps a lot!",
    "Can you make it funnier?", "Is there anything I should avoid?", "Can you give me a quick checklist?",
]
STYLES = ["more formal", "more friendly", "shorter", "simpler", "more polite", "more exciting", "clearer",
          "suitable for a child", "more persuasive", "more concise"]

# ------------------------------------------------------------------ templates

EXPLAIN = [
    "Explain {t} in simple terms.", "Can you explain {t}?", "What is {t}?", "How does {t} work?",
    "Explain {t} to a ten-year-old.", "Give me a short explanation of {t}.", "Why is {t} important?",
    "I never understood {t}. Can you help me?", "What should everyone know about {t}?",
    "Tell me about {t}.", "Describe {t} in a few sentences.", "What are the basics of {t}?",
]
HOW = [
    "How do I {h}?", "What's the best way to {h}?", "Give me step-by-step instructions to {h}.",
    "Can you tell me how to {h}?", "I want to {h}. Where do I start?", "What is the easiest way to {h}?",
    "Explain how to {h}.", "Any tips on how to {h}?",
]
ADVICE = [
    "I {s}. What should I do?", "Any advice for someone who {s}?", "I {s}. Can you help me?",
    "What would you suggest? I {s}.", "Give me {n} tips for {e}.", "How can I get better at {e}?",
    "What are common mistakes people make when {e}?", "I'm struggling with {e}. Any advice?",
]
COMPARE_TEMPLATES = [
    "What is the difference between {a} and {b}?", "Compare {a} and {b}.", "{A} or {b}: what are the pros and cons?",
    "How is {a} different from {b}?",
]
COMPARE_FOR = ["Which is better for {p}, {a} or {b}?", "Should I choose {a} or {b} for {p}?"]
STORY = [
    "Write a short story about {h} who {e}.", "Tell me a story about {h}.", "Write a bedtime story about {h} who {e}.",
    "Write a story of about 100 words about {h} who {e}.", "Can you write a funny story about {h}?",
    "Write the opening paragraph of a story about {h} who {e}.",
]
POEM = ["Write {f} about {x}.", "Can you write {f} about {x}?", "Compose {f} about {x}.", "I'd love {f} about {x}."]
LISTS = ["List {n} {i}.", "Give me {n} {i}.", "What are some {i}?", "Can you suggest {n} {i}?", "Name {n} {i}."]
EMAIL = ["Write {tone} email to {who} about {what}.", "Help me write {tone} message to {who} about {what}.",
         "Draft {tone} email to {who} about {what}."]
SUMMARY = [
    "Summarize the following paragraph in {k}:\n\n{p}", "Summarize this text in {k}.\n\n{p}",
    "{p}\n\nCan you summarize the paragraph above in {k}?", "What is the main idea of this paragraph?\n\n{p}",
    "Give me the key points of this text as a short list:\n\n{p}",
]
REWRITE = [
    "Rewrite the following paragraph to make it {y}:\n\n{p}", "Make this text {y}:\n\n{p}",
    "{p}\n\nRewrite the text above so it is {y}.", "Explain this paragraph in plain English:\n\n{p}",
    "Fix any grammar problems and make this {y}:\n\n{p}",
]
SUMMARY_LENGTHS = ["one sentence", "two sentences", "three sentences", "a few words", "simple words"]
NUMBERS = ["three", "five", "four", "seven", "ten", "3", "5"]

KINDS = ("explanation", "how-to", "advice", "comparison", "story", "poem", "list", "email", "summary", "rewrite")


def _cap(text: str) -> str:
    return text[:1].upper() + text[1:]


def _explanation(rng: random.Random, _: list[str]) -> str:
    return rng.choice(EXPLAIN).format(t=rng.choice(SCIENCE + SOCIETY + TECH))


def _how_to(rng: random.Random, _: list[str]) -> str:
    return rng.choice(HOW).format(h=rng.choice(HOW_TO))


def _advice(rng: random.Random, _: list[str]) -> str:
    return rng.choice(ADVICE).format(s=rng.choice(SITUATIONS), e=rng.choice(EVERYDAY), n=rng.choice(NUMBERS))


def _comparison(rng: random.Random, _: list[str]) -> str:
    a, b, purpose = rng.choice(COMPARE)
    if purpose is not None and rng.random() < 0.4:
        return rng.choice(COMPARE_FOR).format(a=a, b=b, p=purpose)
    return rng.choice(COMPARE_TEMPLATES).format(a=a, b=b, A=_cap(a))


def _story(rng: random.Random, _: list[str]) -> str:
    return rng.choice(STORY).format(h=rng.choice(STORY_HEROES), e=rng.choice(STORY_EVENTS))


def _poem(rng: random.Random, _: list[str]) -> str:
    return rng.choice(POEM).format(f=rng.choice(POEM_FORMS), x=rng.choice(POEM_SUBJECTS))


def _list(rng: random.Random, _: list[str]) -> str:
    return rng.choice(LISTS).format(n=rng.choice(NUMBERS), i=rng.choice(LIST_ITEMS))


def _email(rng: random.Random, _: list[str]) -> str:
    tone, who, what = rng.choice(EMAIL_TASKS)
    return rng.choice(EMAIL).format(tone=tone, who=who, what=what)


def _paragraph(rng: random.Random, stdlib: list[str]) -> str:
    return rng.choice(stdlib) if stdlib and rng.random() < STDLIB_PARAGRAPH_SHARE else everyday_paragraph(rng)


def _summary(rng: random.Random, stdlib: list[str]) -> str:
    return rng.choice(SUMMARY).format(k=rng.choice(SUMMARY_LENGTHS), p=_paragraph(rng, stdlib))


def _rewrite(rng: random.Random, stdlib: list[str]) -> str:
    return rng.choice(REWRITE).format(y=rng.choice(STYLES), p=_paragraph(rng, stdlib))


_MAKERS = {"explanation": _explanation, "how-to": _how_to, "advice": _advice, "comparison": _comparison,
           "story": _story, "poem": _poem, "list": _list, "email": _email, "summary": _summary, "rewrite": _rewrite}
#: How often each kind is drawn (summaries and rewrites carry long prompts: fewer of them).
KIND_WEIGHTS = {"explanation": 4, "how-to": 3, "advice": 3, "comparison": 2, "story": 2, "poem": 2, "list": 2,
                "email": 1, "summary": 1.5, "rewrite": 1}
#: Share of conversations with a second user turn (a follow-up on the target's own answer).
MULTI_TURN_SHARE = 0.15


# ------------------------------------------------------------------ paragraphs

# Everyday paragraphs to summarise or rewrite: frames (a news item, a review, a diary
# entry, a note from work, a notice, a science snippet) whose slots are filled from lists.
PARAGRAPH_FRAMES = [
    "{town} opened a new {place} on {day}. The project cost {money} and took {years} years to finish, "
    "mostly because {delay}. Local residents say {opinion}. The mayor hopes the {place} will {hope}. "
    "Critics, however, point out that {criticism}, and they have asked for a public meeting next month.",
    "I bought the {product} three weeks ago after reading many reviews. The first thing I noticed was that "
    "{good}. On the other hand, {bad}. Customer service was {service} when I called with a question. "
    "Overall, I would {verdict} it to a friend, especially if {condition}.",
    "Today we arrived in {town} after a long {trip}. The weather was {weather}, so we {activity}. "
    "In the evening we found a small restaurant where {food}. Tomorrow we plan to {plan}, "
    "although {worry}. I am tired but very happy that we came.",
    "Hi everyone, a quick update from the {team} team. This week we {progress}. "
    "The main problem right now is that {problem}, which means {consequence}. "
    "Next week we will {next}. If you have questions, please {contact} before Thursday.",
    "Please note that the {place} will be closed from {day} until further notice because {delay}. "
    "During this time, {alternative}. We apologise for any inconvenience and thank you for your patience. "
    "Updates will be posted {where}.",
    "Scientists studying {subject} have found that {finding}. The study followed {group} for {years} years. "
    "According to the researchers, {explanation}. They warn, however, that {caveat}, "
    "and more work is needed before firm conclusions can be drawn.",
]
SLOTS = {
    "town": ["Riverton", "the town of Hallam", "Port Emery", "a small village near the coast", "Lisbon", "Kyoto",
             "the city centre", "Greenfield", "Oakridge", "a mountain town"],
    "place": ["library", "swimming pool", "bridge", "community garden", "train station", "museum", "sports hall",
              "bike path", "market hall", "children's playground"],
    "day": ["Monday", "the first of May", "Saturday morning", "last weekend", "the 12th of March", "Friday"],
    "money": ["four million euros", "about two million dollars", "more than expected", "half a million pounds"],
    "years": ["two", "three", "five", "ten", "seven"],
    "delay": ["the budget had to be approved twice", "heavy rain flooded the site", "several suppliers went bankrupt",
              "old pipes were found under the ground", "of a shortage of workers", "the plans changed twice"],
    "opinion": ["it was worth the wait", "they will use it every week", "it is too far from the centre",
                "the design is beautiful but the parking is poor", "it will bring more visitors"],
    "hope": ["bring people together", "attract young families", "reduce traffic in the centre",
             "help local shops", "become a meeting point for the whole region"],
    "criticism": ["the money could have been spent on schools", "the opening hours are too short",
                  "nobody asked the neighbours for their opinion", "the running costs are still unknown"],
    "product": ["coffee machine", "pair of running shoes", "robot vacuum cleaner", "electric toothbrush",
                "laptop bag", "kitchen scale", "smart watch", "camping tent", "desk lamp", "blender"],
    "good": ["it is very easy to set up", "the battery lasts for days", "it feels solid and well made",
             "it is much quieter than my old one", "the design looks great in my kitchen"],
    "bad": ["the instructions are confusing", "it is heavier than I expected", "the app keeps disconnecting",
            "it is quite expensive", "the cable is too short"],
    "service": ["friendly and quick", "slow but helpful", "not very helpful", "excellent"],
    "verdict": ["recommend", "probably recommend", "not recommend", "happily recommend"],
    "condition": ["they have a small kitchen", "they travel a lot", "the price drops a little", "they are beginners"],
    "trip": ["train journey", "drive through the hills", "flight with two delays", "ferry crossing", "bus ride"],
    "weather": ["warm and sunny", "cold and windy", "rainy all afternoon", "surprisingly mild"],
    "activity": ["walked along the river", "stayed inside and played cards", "visited the old castle",
                 "went to the market", "took a boat tour"],
    "food": ["the owner cooked fresh fish for us", "we tried the local soup", "the bread was still warm",
             "we shared a huge plate of pasta"],
    "plan": ["climb the hill above the town", "rent bicycles", "visit the museum", "take the early train to the coast"],
    "worry": ["the forecast says it might rain", "we still have not booked a hotel", "my knee hurts a little",
              "the museum may be closed"],
    "team": ["design", "support", "marketing", "data", "events", "product"],
    "progress": ["finished the first version of the new website", "interviewed ten customers",
                 "fixed most of the reported bugs", "moved all files to the new server", "planned the spring event"],
    "problem": ["two people are on holiday", "the supplier is late", "the test results are unclear",
                "we are waiting for the budget to be approved"],
    "consequence": ["the launch may move by a week", "some tasks will wait", "we need help from another team",
                    "the report will be shorter than planned"],
    "next": ["share a draft with everyone", "run a small test with real users", "finish the documentation",
             "meet the client on Tuesday"],
    "contact": ["send me an email", "drop by my desk", "write in the team chat", "add them to the shared document"],
    "alternative": ["visitors can use the entrance on the north side", "online services remain available",
                    "a temporary service runs every thirty minutes", "please visit our second location"],
    "where": ["on our website", "at the main entrance", "in the weekly newsletter", "on the notice board"],
    "subject": ["sleep", "honeybees", "coffee drinkers", "city trees", "children's reading habits", "ocean currents",
                "memory in older adults", "migrating birds"],
    "finding": ["short daily walks improve mood", "noise at night affects learning", "small changes in temperature "
                "change behaviour", "regular reading improves vocabulary faster than expected",
                "green spaces lower stress levels"],
    "group": ["two thousand volunteers", "several colonies", "a group of schools", "hundreds of households"],
    "explanation": ["the effect appears within a few weeks", "the results were similar in every country studied",
                    "simple habits matter more than expensive equipment", "the effect is strongest in winter"],
    "caveat": ["the study was small", "other factors may play a role", "the results have not yet been repeated",
               "most participants came from one region"],
}
_SLOT = re.compile(r"{(\w+)}")


def everyday_paragraph(rng: random.Random) -> str:
    frame = rng.choice(PARAGRAPH_FRAMES)
    return _SLOT.sub(lambda m: rng.choice(SLOTS[m.group(1)]), frame)


# Prose, not API reference: no code, no option lists.
_NOT_PROSE = re.compile(r"[{}\[\]<>=_*`|#\\@$%]|>>>|\b(?:def|return|None|True|False|self|kwargs)\b|\.\w+\(|:\s*$",
                        re.MULTILINE)


def stdlib_paragraphs(min_words: int = 30, max_words: int = 160) -> list[str]:
    """Prose paragraphs from the standard library's module and class docstrings, deduplicated."""
    from .prompts import IMPORT_DENYLIST

    names = sorted(m for m in getattr(sys, "stdlib_module_names", ()) if not m.startswith("_") and m not in IMPORT_DENYLIST)
    found: dict[str, None] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in names:
            try:
                module = importlib.import_module(name)
            except Exception:  # noqa: BLE001 - optional stdlib parts differ by platform
                continue
            docs = [inspect.getdoc(module)] + [inspect.getdoc(obj) for obj in vars(module).values()
                                              if inspect.isclass(obj) and getattr(obj, "__module__", None) == name]
            for doc in docs:
                for block in (doc or "").split("\n\n"):
                    text = " ".join(block.split())
                    words = len(text.split())
                    if min_words <= words <= max_words and not _NOT_PROSE.search(block) and text[-1:] in ".!?":
                        found[text] = None
    return list(found)


#: Share of the paragraphs to summarise or rewrite taken from the standard library's docstrings
#: (technical prose); the rest are everyday paragraphs.
STDLIB_PARAGRAPH_SHARE = 0.2


def chat_conversations(count: int, seed: int = 0) -> list[tuple[str, ...]]:
    """``count`` distinct conversations (tuples of user turns), deterministic for a seed."""
    rng = random.Random(seed)
    paragraphs = stdlib_paragraphs()
    kinds = list(KIND_WEIGHTS)
    weights = [KIND_WEIGHTS[k] for k in kinds]
    seen: set[tuple[str, ...]] = set()
    out: list[tuple[str, ...]] = []
    attempts = 0
    while len(out) < count and attempts < count * 50:
        attempts += 1
        kind = rng.choices(kinds, weights)[0]
        first = _MAKERS[kind](rng, paragraphs)
        turns = (first, rng.choice(FOLLOW_UPS)) if rng.random() < MULTI_TURN_SHARE else (first,)
        if turns not in seen:
            seen.add(turns)
            out.append(turns)
    return out

"""Deterministic, real-looking English for the prefix-caching workloads of `scripts/bench`.

Every text is built from a seed string with its own `random.Random` (string seeds hash with
SHA-512, so the text is the same in every run and on every machine): an agent's system prompt (a
company assistant's brief, with policies and reference notes), a user turn (a request about a
ticket), a shared handbook and questions about it. Lengths are in the benchmarked tokenizer's tokens.
"""

from __future__ import annotations

import random

COMPANIES = [
    ("Harbor & Finch Logistics", "freight forwarding", "Rotterdam"),
    ("Bluebell Clinics", "outpatient care", "Leeds"),
    ("Northwind Energy", "residential solar installation", "Aarhus"),
    ("Copperleaf Bank", "small-business lending", "Porto"),
    ("Meridian Travel", "group tours", "Lyon"),
    ("Quarry Lane Software", "payroll software", "Tallinn"),
    ("Saltmarsh Foods", "wholesale seafood", "Galway"),
    ("Tern Aviation Services", "aircraft maintenance", "Toulouse"),
]
ASSISTANTS = ["Mira", "Otto", "Lena", "Ravi", "Ines", "Tomas", "Nadia", "Joel"]
ROLES = [
    "operations assistant",
    "customer support agent",
    "scheduling coordinator",
    "billing specialist",
    "compliance reviewer",
    "field service dispatcher",
    "account manager",
    "procurement assistant",
]
TEAMS = [
    "the dispatch desk",
    "the finance team",
    "the quality office",
    "the night shift",
    "regional managers",
    "the warehouse crew",
    "the legal department",
    "the onboarding team",
    "field technicians",
    "the help desk",
]
THINGS = [
    "refund requests",
    "delivery windows",
    "damaged goods reports",
    "invoice disputes",
    "contract renewals",
    "safety inspections",
    "overtime approvals",
    "supplier onboarding",
    "data access requests",
    "appointment changes",
    "price adjustments",
    "warranty claims",
    "route changes",
    "audit findings",
    "equipment returns",
    "service outages",
    "travel bookings",
    "credit limits",
    "shift handovers",
    "customer complaints",
]
ACTIONS = [
    "confirm",
    "escalate",
    "document",
    "review",
    "approve",
    "reject",
    "schedule",
    "summarise",
    "verify",
    "forward",
    "archive",
    "reconcile",
    "prioritise",
    "flag",
    "acknowledge",
]
QUALIFIERS = [
    "within two working days",
    "before the end of the shift",
    "only after a second review",
    "unless a manager has signed off",
    "in the shared tracker",
    "with the original reference number",
    "using the standard template",
    "when the amount exceeds the usual threshold",
    "for repeat customers",
    "during the quarterly close",
    "if the customer asks for it in writing",
    "at the weekly review",
    "before any money moves",
    "as soon as the cause is known",
    "in plain language",
]
REASONS = [
    "customers judge us on how quickly we answer",
    "auditors check this every quarter",
    "mistakes here are expensive to undo",
    "the contract requires it",
    "it keeps the teams in step",
    "we were fined for it once",
    "it protects personal data",
    "it saves a round of emails",
    "regional offices rely on the same records",
    "it makes handovers painless",
]
PLACES = [
    "Rotterdam",
    "Hamburg",
    "Antwerp",
    "Leeds",
    "Dublin",
    "Lyon",
    "Porto",
    "Tallinn",
    "Aarhus",
    "Galway",
    "Toulouse",
    "Milan",
    "Gdansk",
    "Valencia",
    "Bergen",
]
NAMES = [
    "Alice Moreau",
    "Ben Okafor",
    "Carla Jensen",
    "Dmitri Volkov",
    "Elena Rossi",
    "Farid Haddad",
    "Greta Lind",
    "Hugo Santos",
    "Ida Novak",
    "Jonas Becker",
    "Kaia Tamm",
    "Luis Ortega",
    "Maeve Byrne",
    "Nils Ekberg",
]

SENTENCES = [
    "Always {action} {thing} {qualifier}, because {reason}.",
    "When {team} asks about {thing}, {action} the request {qualifier}.",
    "Do not {action} {thing} on your own; {team} owns that decision, and {reason}.",
    "For {thing} from {place}, {action} the details {qualifier} and tell {team}.",
    "If a customer is unhappy about {thing}, apologise once, {action} the facts, and offer a clear next step.",
    "{team_cap} expects you to {action} {thing} {qualifier}.",
    "Keep notes on {thing} short: what happened, what you did, and who will {action} it next.",
    "Our office in {place} handles {thing}; {action} anything unusual {qualifier}.",
    "Never promise a date for {thing} that {team} has not confirmed, since {reason}.",
    "Treat {thing} as urgent when the customer mentions a deadline, and {action} it {qualifier}.",
    "Ask {name} in {place} before you {action} {thing} that look unusual.",
    "Last year we changed how we {action} {thing}: it now happens {qualifier}.",
]
USER_SENTENCES = [
    "I have a question about {thing} for an order shipped from {place}.",
    "{name} told me last week that you would {action} it {qualifier}, but nothing has happened yet.",
    "Could you {action} the status of our {thing} and tell me who is handling it?",
    "We are under some pressure here, because {reason}.",
    "The reference on our side is {ref}, and the contact is {name}.",
    "Please also check whether {team} has seen the note about {thing}.",
    "If you need anything else from me, I can send it {qualifier}.",
    "It would help a lot if you could {action} this before Friday.",
]
QUESTIONS = [
    "According to the handbook, who decides on {thing} from {place}?",
    "What should I do first when a customer complains about {thing}?",
    "How quickly must we {action} {thing}, and why?",
    "Which team do I tell about {thing} when the amount is unusual?",
    "Can I {action} {thing} without a manager's sign-off?",
    "What goes into the notes on {thing}?",
]
SECTIONS = [
    "Policies",
    "How we work",
    "Escalation",
    "Records and notes",
    "Tone with customers",
    "Reference: offices and contacts",
    "Common cases",
    "Things to avoid",
]


def _fill(rng: random.Random, template: str) -> str:
    team, ref = rng.choice(TEAMS), f"{rng.choice('ABCDEFGH')}-{rng.randint(1000, 9999)}"
    return template.format(
        action=rng.choice(ACTIONS),
        thing=rng.choice(THINGS),
        qualifier=rng.choice(QUALIFIERS),
        reason=rng.choice(REASONS),
        place=rng.choice(PLACES),
        name=rng.choice(NAMES),
        team=team,
        team_cap=team[0].upper() + team[1:],
        ref=ref,
    )


def _grow(tokenizer, head: str, tokens: int, next_part) -> str:
    """`head` and then parts from `next_part()` until the text holds about `tokens` tokens (parts are
    counted one by one, which is within a few tokens of counting the whole)."""
    parts, count = [head], len(tokenizer.encode(head, add_special_tokens=False))
    while count < tokens:
        part = next_part()
        parts.append(part)
        count += len(tokenizer.encode(part, add_special_tokens=False))
    return "".join(parts)


def _brief(tokenizer, rng: random.Random, head: str, tokens: int) -> str:
    """`head`, then sections of rules (a heading every few sentences) up to about `tokens` tokens."""
    state = {"left": 0}

    def part() -> str:
        if state["left"] == 0:
            state["left"] = rng.randint(4, 8)
            return f"\n## {rng.choice(SECTIONS)}\n"
        state["left"] -= 1
        return f"- {_fill(rng, rng.choice(SENTENCES))}\n"

    return _grow(tokenizer, head, tokens, part)


def system_prompt(tokenizer, agent: int, tokens: int) -> str:
    """Agent `agent`'s brief: about `tokens` tokens, distinct from every other agent's from its first words."""
    company, trade, city = COMPANIES[agent % len(COMPANIES)]
    name, role = ASSISTANTS[agent % len(ASSISTANTS)], ROLES[agent % len(ROLES)]
    desk = f" (desk {agent // len(COMPANIES) + 1})" if agent >= len(COMPANIES) else ""
    head = (
        f"You are {name}, the {role} of {company}{desk}, a company in {trade} based in {city}. "
        f"You answer colleagues and customers by chat. Be accurate, brief and friendly, and say so plainly "
        f"when you do not know something.\n"
    )
    return _brief(tokenizer, random.Random(f"system-{agent}"), head, tokens)


def user_turn(tokenizer, agent: int, turn: int, tokens: int) -> str:
    """Agent `agent`'s user message of turn `turn`: about `tokens` new tokens."""
    rng = random.Random(f"user-{agent}-{turn}")
    head = f"Message {turn + 1} from {rng.choice(NAMES)}: "
    return _grow(
        tokenizer, head, tokens, lambda: _fill(rng, rng.choice(USER_SENTENCES)) + " "
    ).rstrip()


def handbook(tokenizer, tokens: int) -> str:
    """The shared prefix of the shared-prefix workload: a staff handbook of about `tokens` tokens."""
    head = (
        "This is the staff handbook of Larkspur Freight, a company in parcel delivery based in Bergen. "
        "Answer questions about it in one or two sentences.\n"
    )
    return _brief(tokenizer, random.Random("handbook"), head, tokens)


def question(index: int) -> str:
    """A short question about the handbook, distinct for every index."""
    rng = random.Random(f"question-{index}")
    return f"Question {index + 1}: {_fill(rng, rng.choice(QUESTIONS))}"


def warm_up(tokenizer, tokens: int) -> str:
    """A system prompt that shares nothing with the measured ones, for each system's warm-up request
    (so that one-off costs of a long prefill stay out of the figures without warming a cache)."""
    head = "These are the minutes of the monthly meeting of the Quayside Rowing Club, held in Bergen.\n"
    return _brief(tokenizer, random.Random("warm-up"), head, tokens)

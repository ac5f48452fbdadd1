"""Multi-tenant workload for the load tests: per-tenant system prompts built from tool definitions.

Each tenant is a made-up company with an assistant whose system prompt lists JSON-schema function
specs (tools/plugins) of its business domain, usage policies and few-shot tool-call examples, all
generated from a seed, so every run (and every locust process) builds the same prompts. Users draw
their questions from a per-tenant pool that refers to the tenant's own tools.

A prompt is ``shared part`` (the leading ``sharing_ratio`` of the tenant's prompt length, identical for
every request of the tenant) + ``unique part`` (per-request session context) + the question. Lengths
are exact when a tokenizer is given (``load_tokenizer``), else estimated at ``CHARS_PER_TOKEN``.

Only the standard library is imported here (locust imports this module in every process).
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

# Characters per token of this text under the SmolLM2 / GPT-2 style BPE tokenizers (measured on
# generated prompts: 3.3-3.6); used only when no tokenizer is given.
CHARS_PER_TOKEN = 3.4

_DOMAINS: dict[str, dict[str, Any]] = {
    "commerce": {"what": "an online retailer of home and garden goods",
                 "entities": ["order", "product", "cart", "refund", "shipment", "coupon", "review"]},
    "travel": {"what": "a travel agency for business trips",
               "entities": ["flight", "hotel_booking", "itinerary", "seat", "visa_check", "car_rental"]},
    "banking": {"what": "a retail bank with mobile and web banking",
                "entities": ["account", "transfer", "card", "statement", "payee", "standing_order"]},
    "devops": {"what": "a cloud platform team running Kubernetes clusters",
               "entities": ["deployment", "incident", "cluster", "pipeline", "alert", "runbook"]},
    "health": {"what": "a network of outpatient clinics",
               "entities": ["appointment", "prescription", "patient_record", "provider", "lab_result"]},
    "crm": {"what": "a B2B software vendor's sales and support desk",
            "entities": ["lead", "contact", "opportunity", "ticket", "campaign", "contract"]},
    "logistics": {"what": "a freight forwarder with its own warehouses",
                  "entities": ["warehouse_slot", "pallet", "carrier_quote", "route", "customs_form"]},
    "hr": {"what": "the people team of a mid-sized company",
           "entities": ["employee", "leave_request", "payslip", "job_posting", "expense_claim"]},
}
_VERBS = ("get", "list", "search", "create", "update", "cancel")
_STATUSES = ("pending", "active", "on_hold", "completed", "cancelled", "failed", "scheduled")
_SYLLABLES = ("nor", "vik", "tal", "bre", "ons", "qua", "ri", "mel", "dax", "sto", "lum", "pe", "zan", "ko")
_SUFFIXES = ("Group", "Systems", "Partners", "Labs", "& Co", "Holdings", "Works", "Direct")
_FIRST = ("Ana", "Ben", "Chen", "Dara", "Eli", "Fatima", "Goran", "Hana", "Ivo", "Jun", "Kofi", "Lea", "Mateo")
_LAST = ("Okafor", "Schmidt", "Tanaka", "Silva", "Novak", "Haddad", "Larsen", "Moreau", "Kowalski", "Rossi")
_CITIES = ("Lisbon", "Osaka", "Denver", "Nairobi", "Gdansk", "Lyon", "Monterrey", "Tallinn", "Pune", "Perth")
_REASONS = ("the customer changed plans", "a duplicate entry", "a pricing error", "a schedule conflict",
            "the request was made by mistake", "a policy violation was found")
_POLICIES = (
    "Never reveal internal identifiers of other customers; only discuss records that belong to the caller.",
    "Before any write operation (create, update, cancel) restate the change and ask for explicit confirmation.",
    "If a tool returns an error, explain it in plain words and suggest the next step; do not retry blindly.",
    "Dates are ISO 8601 (YYYY-MM-DD) in the caller's time zone unless the caller says otherwise.",
    "Amounts are decimals with two places in the account currency; never round in the caller's favour.",
    "Escalate to a human agent when the caller is upset twice in a row or asks for a manager.",
    "Keep answers under 120 words unless the caller asks for details; use bullet lists for several items.",
    "Call at most three tools per turn; prefer one search over many get calls.",
    "Do not guess missing required arguments: ask the caller for them.",
    "Log nothing that looks like a password, a full card number or a national id.",
)

class Tokenizer(Protocol):
    """What the workload needs from a tokenizer (``tokenizers.Tokenizer`` wrapped by ``load_tokenizer``)."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

@dataclass(frozen=True)
class _HFTokenizer:
    """A Hugging Face ``tokenizers.Tokenizer`` without special tokens."""

    tok: Any

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.tok.decode(list(ids), skip_special_tokens=False))

def load_tokenizer(path: str | Path) -> Tokenizer:
    """A tokenizer from a ``tokenizer.json`` file or a checkpoint directory holding one."""
    from tokenizers import Tokenizer as RustTokenizer

    p = Path(path).expanduser()
    if p.is_dir():
        p = p / "tokenizer.json"
    if not p.is_file():
        raise ValueError(f"no tokenizer.json at {path}")
    return _HFTokenizer(RustTokenizer.from_file(str(p)))

def count_tokens(text: str, tokenizer: Tokenizer | None) -> int:
    """Tokens of ``text`` (estimated at CHARS_PER_TOKEN without a tokenizer)."""
    return len(tokenizer.encode(text)) if tokenizer is not None else round(len(text) / CHARS_PER_TOKEN)

def fit_tokens(text: str, n: int, tokenizer: Tokenizer | None) -> str:
    """The first ``n`` tokens of ``text`` (``text`` must be long enough)."""
    if n <= 0:
        return ""
    if tokenizer is None:
        return text[: int(n * CHARS_PER_TOKEN)]
    return tokenizer.decode(tokenizer.encode(text)[:n])

# ---------------------------------------------------------------------------------------- tool specs
def _company(rng: random.Random) -> str:
    name = "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 3))).capitalize()
    return f"{name} {rng.choice(_SUFFIXES)}"

def _a(noun: str) -> str:
    return ("an " if noun[0] in "aeiou" else "a ") + noun


def _id_param(entity: str, rng: random.Random) -> tuple[str, dict[str, Any]]:
    prefix = "".join(w[0] for w in entity.split("_")).upper() + entity[1:3].upper()
    return f"{entity}_id", {"type": "string", "pattern": f"^{prefix}-[0-9]{{{rng.choice((6, 8, 10))}}}$",
                            "description": f"Identifier of the {entity.replace('_', ' ')}, e.g. "
                                           f"{prefix}-{rng.randrange(10**5, 10**6)}."}

def _extra_params(entity: str, rng: random.Random) -> dict[str, dict[str, Any]]:
    noun = entity.replace("_", " ")
    pool: list[tuple[str, dict[str, Any]]] = [
        ("status", {"type": "string", "enum": rng.sample(_STATUSES, 4), "description": f"Status of the {noun}."}),
        ("from_date", {"type": "string", "format": "date", "description": "Start of the period (inclusive)."}),
        ("to_date", {"type": "string", "format": "date", "description": "End of the period (inclusive)."}),
        ("limit", {"type": "integer", "minimum": 1, "maximum": rng.choice((50, 100, 200)),
                   "default": rng.choice((10, 20, 25)), "description": "Maximum number of results."}),
        ("notify_customer", {"type": "boolean", "default": rng.random() < 0.5,
                             "description": "Send an e-mail or push notification about the change."}),
        ("tags", {"type": "array", "items": {"type": "string"}, "maxItems": rng.choice((5, 10)),
                  "description": f"Free-form labels attached to the {noun}."}),
        ("amount", {"type": "number", "minimum": 0, "description": "Amount in the account currency."}),
        ("note", {"type": "string", "maxLength": rng.choice((280, 500, 1000)),
                  "description": "A short note that is stored with the record and visible to agents."}),
        ("address", {"type": "object", "description": "Postal address.", "properties": {
            "street": {"type": "string"}, "city": {"type": "string"},
            "postal_code": {"type": "string"}, "country": {"type": "string", "pattern": "^[A-Z]{2}$"}},
            "required": ["street", "city", "country"]}),
        ("priority", {"type": "string", "enum": ["low", "normal", "high", "urgent"], "default": "normal",
                      "description": "How fast the request must be handled."}),
    ]
    return dict(rng.sample(pool, rng.randint(2, 4)))

def _tool(domain: str, entity: str, verb: str, rng: random.Random) -> dict[str, Any]:
    noun = entity.replace("_", " ")
    id_name, id_schema = _id_param(entity, rng)
    props: dict[str, Any] = {}
    required: list[str] = []
    if verb in ("get", "update", "cancel"):
        props[id_name] = id_schema
        required.append(id_name)
    if verb == "search":
        props["query"] = {"type": "string", "description": f"Words to look for in the {noun} fields."}
        required.append("query")
    if verb == "cancel":
        props["reason"] = {"type": "string", "description": "Why it is cancelled (shown to the customer)."}
        required.append("reason")
    props.update(_extra_params(entity, rng))
    if verb == "create":
        required.extend(rng.sample(sorted(props), min(2, len(props))))
    does = {"get": f"Fetch one {noun} with all its fields", "list": f"List {noun}s, newest first",
            "search": f"Full-text search over {noun}s", "create": f"Create a new {noun}",
            "update": f"Change fields of an existing {noun}; fields left out stay unchanged",
            "cancel": f"Cancel {_a(noun)}; this cannot be undone after 24 hours"}[verb]
    return {"type": "function", "function": {
        "name": f"{verb}_{entity}", "description": f"{does}. Part of the {domain} API v{rng.randint(1, 4)}.",
        "parameters": {"type": "object", "properties": props, "required": required}}}

def _example_args(tool: dict[str, Any], rng: random.Random) -> dict[str, Any]:
    args: dict[str, Any] = {}
    for name, schema in tool["function"]["parameters"]["properties"].items():
        t = schema.get("type")
        if name.endswith("_id"):
            args[name] = schema["description"].rsplit("e.g. ", 1)[-1].rstrip(".")
        elif "enum" in schema:
            args[name] = rng.choice(schema["enum"])
        elif schema.get("format") == "date":
            args[name] = f"2026-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
        elif t == "integer":
            args[name] = rng.randint(1, 50)
        elif t == "number":
            args[name] = round(rng.uniform(5, 900), 2)
        elif t == "boolean":
            args[name] = rng.random() < 0.5
        elif t == "array":
            args[name] = rng.sample(["vip", "urgent", "b2b", "follow-up", "review", "eu"], 2)
        elif t == "object":
            args[name] = {"street": f"{rng.randint(1, 200)} Harbour Road", "city": rng.choice(_CITIES),
                          "country": rng.choice(["PT", "JP", "US", "KE", "PL", "FR"])}
        elif name in ("query", "note", "reason"):
            args[name] = rng.choice(_REASONS) if name == "reason" else f"{rng.choice(_FIRST)} {rng.choice(_CITIES)}"
    return args

def _question(tool: dict[str, Any], rng: random.Random, args: dict[str, Any] | None = None) -> str:
    fn = tool["function"]
    verb, entity = fn["name"].split("_", 1)
    noun = entity.replace("_", " ")
    args = _example_args(tool, rng) if args is None else args
    ident = next((v for k, v in args.items() if k.endswith("_id")), f"#{rng.randrange(10**4, 10**5)}")
    who = f"{rng.choice(_FIRST)} {rng.choice(_LAST)}"
    return {
        "get": f"Hi, this is {who}. What is the current state of {noun} {ident}, and is anything blocking it?",
        "list": f"Can you show me my {noun}s from {args.get('from_date', 'last month')} onwards? Only the "
                f"ones that are {args.get('status', 'still open')}, please.",
        "search": f"I am looking for {_a(noun)} that mentions {rng.choice(_CITIES)}; {who} created it I think.",
        "create": f"Please set up a new {noun} for {who} in {rng.choice(_CITIES)} with priority "
                  f"{args.get('priority', 'normal')}.",
        "update": f"For {noun} {ident}, set the note to '{rng.choice(_REASONS)}' and tag it for review.",
        "cancel": f"I need to cancel {noun} {ident} because of {rng.choice(_REASONS)}. Can you do that today?",
    }[verb]

def _few_shot(tool: dict[str, Any], rng: random.Random) -> str:
    call = {"name": tool["function"]["name"], "arguments": _example_args(tool, rng)}
    return (f"User: {_question(tool, rng, call['arguments'])}\nAssistant: <tool_call>{json.dumps(call)}</tool_call>\n"
            f"Tool: {json.dumps({'ok': True, 'request_id': f'req-{rng.randrange(16**8):08x}'})}\n"
            f"Assistant: Done. I used {call['name']} and the system confirmed the request.\n")

# -------------------------------------------------------------------------------------------- tenants
@dataclass(frozen=True)
class TenantWorkload:
    """One tenant's prompts: the shared system-prompt part, a question pool and its session generator."""

    tenant_id: str
    api_key: str | None
    company: str
    shared_prompt: str  # identical for every request of this tenant
    unique_tokens: int  # per-request session context appended to the system prompt
    questions: tuple[str, ...]
    seed: int

    def unique_context(self, rng: random.Random, tokenizer: Tokenizer | None) -> str:
        """Per-request session context (user profile and recent turns) of about ``unique_tokens``."""
        if self.unique_tokens <= 0:
            return ""
        lines = [f"# Session {rng.randrange(16**12):012x}",
                 f"Caller: {rng.choice(_FIRST)} {rng.choice(_LAST)}, customer since {rng.randint(2009, 2026)}, "
                 f"tier {rng.choice(['basic', 'plus', 'gold', 'enterprise'])}, city {rng.choice(_CITIES)}."]
        while sum(len(x) for x in lines) < self.unique_tokens * CHARS_PER_TOKEN * 1.3 + 64:
            lines.append(f"[{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}] caller: "
                         f"{rng.choice(self.questions)} / agent: noted, reference "
                         f"{rng.randrange(10**7, 10**8)}.")
        return fit_tokens("\n".join(lines), self.unique_tokens, tokenizer)

    def system_prompt(self, rng: random.Random, tokenizer: Tokenizer | None) -> str:
        unique = self.unique_context(rng, tokenizer)
        return self.shared_prompt + ("\n\n" + unique if unique else "")

def tenant_prompt(seed: int, n_tokens: int, tokenizer: Tokenizer | None) -> tuple[str, str, list[dict]]:
    """(company, system prompt of exactly ``n_tokens`` tokens, its tools) for one tenant seed."""
    rng = random.Random(seed)
    domain = rng.choice(sorted(_DOMAINS))
    company = _company(rng)
    info = _DOMAINS[domain]
    head = (f"You are the virtual assistant of {company}, {info['what']}. You help callers by calling the "
            f"functions below and explaining the results. Today is 2026-{rng.randint(1, 12):02d}-"
            f"{rng.randint(1, 28):02d}.\n\n# Policies\n"
            + "".join(f"{i + 1}. {p}\n" for i, p in enumerate(rng.sample(_POLICIES, 6)))
            + "\n# Tools\nCall a function by answering with <tool_call>{\"name\": ..., \"arguments\": {...}}"
              "</tool_call> and nothing else. Available functions (JSON schema):\n<tools>\n")
    parts, tools = [head], []
    combos = [(e, v) for e in info["entities"] for v in _VERBS]
    rng.shuffle(combos)
    target_chars = n_tokens * CHARS_PER_TOKEN * 1.4 + 256
    k = 0
    while sum(len(p) for p in parts) < target_chars:
        entity, verb = combos[k % len(combos)]
        if k >= len(combos):  # a second API version of the same resource, as plugin catalogs have
            entity = f"{entity}_v{k // len(combos) + 1}"
        tool = _tool(domain, entity, verb, rng)
        tools.append(tool)
        parts.append(json.dumps(tool) + "\n")
        if k % 4 == 3:
            parts.append("</tools>\n# Example\n" + _few_shot(rng.choice(tools), rng) + "<tools>\n")
        k += 1
    text = "".join(parts)
    if tokenizer is not None and len(tokenizer.encode(text)) < n_tokens:
        raise RuntimeError("internal: generated prompt shorter than requested")  # the margin above is ample
    return company, fit_tokens(text, n_tokens, tokenizer), tools

@dataclass(frozen=True)
class WorkloadConfig:
    """How the tenants' prompts look (the locust CLI flags map onto these fields)."""

    num_tenants: int = 4
    prompt_tokens: tuple[int, ...] = (1024,)  # per tenant, round-robin; system prompt length
    sharing_ratio: float = 1.0  # leading fraction of the system prompt shared by a tenant's requests
    questions_per_tenant: int = 32  # 0: no user question (the prompt is the system prompt only)
    seed: int = 0
    api_keys: dict[str, str] = field(default_factory=dict)  # tenant id -> plain key; empty: open mode

    def __post_init__(self) -> None:
        if self.num_tenants < 1:
            raise ValueError(f"num_tenants must be >= 1, got {self.num_tenants}")
        if not self.prompt_tokens or any(n < 16 or n > 32768 for n in self.prompt_tokens):
            raise ValueError(f"prompt lengths must be in [16, 32768] tokens, got {self.prompt_tokens}")
        if not 0.0 <= self.sharing_ratio <= 1.0:
            raise ValueError(f"sharing_ratio must be in [0, 1], got {self.sharing_ratio}")
        if self.questions_per_tenant < 0:
            raise ValueError("questions_per_tenant must be >= 0")
        if self.api_keys and len(self.api_keys) < self.num_tenants:
            raise ValueError(f"{self.num_tenants} tenants but only {len(self.api_keys)} API keys")

def build_workload(cfg: WorkloadConfig, tokenizer: Tokenizer | None = None) -> list[TenantWorkload]:
    """The tenants of ``cfg``, in a deterministic order (tenant i gets prompt length i mod len)."""
    ids = sorted(cfg.api_keys)[: cfg.num_tenants] if cfg.api_keys else [f"tenant{i}" for i in range(cfg.num_tenants)]
    out = []
    for i, tid in enumerate(ids):
        n = cfg.prompt_tokens[i % len(cfg.prompt_tokens)]
        n_shared = round(n * cfg.sharing_ratio)
        seed = cfg.seed * 1_000_003 + i
        company, shared, tools = tenant_prompt(seed, max(n_shared, 1), tokenizer)
        rng = random.Random(seed + 7)
        questions = tuple(_question(rng.choice(tools), rng) for _ in range(cfg.questions_per_tenant))
        if n_shared == 0:
            shared = ""
        out.append(TenantWorkload(tenant_id=tid, api_key=cfg.api_keys.get(tid), company=company,
                                  shared_prompt=shared, unique_tokens=n - n_shared,
                                  questions=questions or (f"Hello {company}.",), seed=seed))
    return out

def read_api_keys(path: str | Path) -> dict[str, str]:
    """An API-keys file: a JSON object ``{"tenant id": "plain key", ...}`` or lines ``<tenant id> <key>``."""
    text = Path(path).read_text(encoding="utf-8")
    if text.lstrip().startswith("{"):
        data = json.loads(text)
        if not isinstance(data, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in data.items()):
            raise ValueError(f"{path}: expected a JSON object of tenant id -> key")
        return dict(data)
    keys: dict[str, str] = {}
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split()
        if len(parts) != 2:
            raise ValueError(f"{path}:{n}: expected '<tenant id> <key>'")
        keys[parts[0]] = parts[1]
    if not keys:
        raise ValueError(f"{path}: no API keys")
    return keys

def parse_lengths(spec: str) -> tuple[int, ...]:
    """'512,1024' -> (512, 1024)."""
    try:
        out = tuple(int(x) for x in spec.replace(" ", "").split(",") if x)
    except ValueError:
        raise ValueError(f"prompt lengths must be comma-separated integers, got {spec!r}") from None
    if not out:
        raise ValueError("no prompt length given")
    return out


def parse_rates(spec: str, num_tenants: int) -> tuple[float, ...]:
    """'10,1' -> relative request rates per tenant, round-robin over ``num_tenants`` like the prompt lengths
    ('' -> equal rates). Rates are >= 0 and at least one is positive."""
    if not spec.strip():
        return (1.0,) * num_tenants
    try:
        given = [float(x) for x in spec.replace(" ", "").split(",") if x]
    except ValueError:
        raise ValueError(f"tenant rates must be comma-separated numbers, got {spec!r}") from None
    if not given or any(not r >= 0 or r == float("inf") for r in given) or not any(r > 0 for r in given):
        raise ValueError(f"tenant rates must be finite, >= 0 and not all 0, got {spec!r}")
    return tuple(given[i % len(given)] for i in range(num_tenants))


def user_rate(total_rate: float, rates: tuple[float, ...], tenant: int, num_users: int) -> float:
    """Requests/s of one user of tenant ``tenant`` (users are assigned to tenants round-robin) so that the
    tenants together send ``total_rate`` split by ``rates``; 0 for a tenant with rate 0 or no users."""
    n = len(rates)
    users_of_tenant = len(range(tenant, max(num_users, 1), n))
    if users_of_tenant == 0:
        return 0.0
    return total_rate * rates[tenant] / sum(rates) / users_of_tenant

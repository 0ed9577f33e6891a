"""The chat workload: everyday requests a user sends an instruct model, in the model's own chat template, replies
ended by its end of turn (at most 256 tokens). The benchmark's headline rows run it greedy and sampled.

The 100 requests mix what people ask of an assistant: short facts, explanations, advice, lists, rewriting and
extraction of a given text, small pieces of code, arithmetic in words. They were written for this benchmark (no
public set is downloaded). Every system gets the same token ids: the template is applied once, here, with the
model's own tokenizer.
"""

from __future__ import annotations

from pathlib import Path

from benchmarks.harness.workload import Decoding, Workload

QUESTIONS: tuple[str, ...] = (
    # facts and short answers
    "What is the capital of Australia?",
    "How many bones are in the adult human body?",
    "Who wrote the novel Pride and Prejudice?",
    "What is the boiling point of water at sea level in Fahrenheit?",
    "Which planet is known as the Red Planet?",
    "What is the largest ocean on Earth?",
    "How many minutes are there in a day?",
    "What language is spoken in Brazil?",
    "What does DNA stand for?",
    "When did the first person walk on the Moon?",
    "What is the chemical symbol for gold?",
    "How many continents are there, and what are they called?",
    # explanations
    "Explain how a refrigerator keeps food cold.",
    "Why is the sky blue?",
    "How does a vaccine help the body fight disease?",
    "Explain the difference between weather and climate.",
    "What is inflation, in simple terms?",
    "How do airplanes stay in the air?",
    "Explain what a credit score is and why it matters.",
    "Why do we have seasons?",
    "What happens when you compile a program?",
    "Explain photosynthesis to a ten-year-old.",
    "What is the difference between a virus and a bacterium?",
    "How does a bicycle stay upright when it is moving?",
    "Why does bread rise when it is baked?",
    "What is the greenhouse effect?",
    # advice
    "How can I improve my sleep?",
    "What should I pack for a three-day hiking trip?",
    "How do I prepare for a job interview?",
    "Give me some tips for learning a new language.",
    "How can I stay focused while working from home?",
    "What is a good way to start running if I have never exercised?",
    "How do I keep my houseplants alive?",
    "How can I save money on groceries?",
    "What should I do if my laptop is running slowly?",
    "How do I write a polite email asking for a deadline extension?",
    "Suggest a healthy breakfast I can make in five minutes.",
    "How do I remove a coffee stain from a white shirt?",
    # lists
    "List five fruits that are high in vitamin C.",
    "Name three famous painters from the Renaissance.",
    "Give me a list of ten common English irregular verbs.",
    "List the planets of the solar system in order from the Sun.",
    "What are four ways to reduce plastic waste at home?",
    "Give me five ideas for a rainy weekend.",
    "List the steps to change a flat tire.",
    "Name some board games that are fun for a family.",
    "What are the main food groups?",
    "List three advantages and three disadvantages of electric cars.",
    # rewriting and style
    "Rewrite this sentence to sound more formal: hey, can you send me that report asap?",
    "Make this sentence shorter: Due to the fact that it was raining, we decided that we would stay inside.",
    "Turn this into a friendly reminder: The meeting is tomorrow at 10.",
    "Correct the grammar: She don't like apples and he have two cats.",
    "Rewrite in plain English: The aforementioned parties shall henceforth comply with the stipulations.",
    "Write a one-sentence summary of the story of Cinderella.",
    "Paraphrase: The quick brown fox jumps over the lazy dog.",
    "Write a short thank-you note to a neighbor who watered my plants.",
    "Write a haiku about autumn leaves.",
    "Write a two-line poem about the sea.",
    "Give me a catchy title for a blog post about home gardening.",
    "Write a short product description for a reusable water bottle.",
    # extraction and classification
    "Extract the names of people from this text: Maria met John and Aisha at the station in Berlin.",
    "What is the date mentioned here: The invoice was issued on March 3, 2024 and is due in 30 days.",
    "Is this review positive or negative: The food was cold and the waiter was rude.",
    "Classify this as a question, a command or a statement: Close the door.",
    "Find the email address in this sentence: Please contact support@example.com for help.",
    "What is the main topic of this sentence: Solar panels turn sunlight into electricity for homes.",
    "Pick out the verbs in: The children ran, laughed and played in the park.",
    "Which of these is a mammal: shark, dolphin, trout?",
    "Sort these numbers from smallest to largest: 42, 7, 19, 3, 88.",
    "Count the vowels in the word education.",
    # code
    "Write a Python function that reverses a string.",
    "Write a Python function that checks whether a number is prime.",
    "How do I read a CSV file in Python?",
    "Write a SQL query that selects all customers from the city of Paris.",
    "What does the git command git status do?",
    "Write a JavaScript function that adds two numbers.",
    "Explain what a for loop is, with a short example.",
    "How do I create a list of the squares of the numbers 1 to 10 in Python?",
    "What is the difference between a list and a tuple in Python?",
    "Write a bash command that counts the lines in a file.",
    "How do I make an HTTP request in Python?",
    "What is recursion? Give a small example.",
    # arithmetic and reasoning in words
    "If I buy three apples at 50 cents each, how much do I pay?",
    "What is 15 percent of 80?",
    "A train leaves at 2 pm and the trip takes 3 hours and 45 minutes. When does it arrive?",
    "How many days are there in a leap year?",
    "If a recipe for 4 people needs 200 grams of rice, how much do I need for 6 people?",
    "What is the next number in the sequence 2, 4, 8, 16?",
    "Convert 5 kilometers to miles.",
    "I have 12 cookies and share them equally among 4 friends. How many does each get?",
    # everyday chat
    "Can you recommend a good book for a long flight?",
    "What is a fun fact about octopuses?",
    "Tell me a short joke about computers.",
    "What are some good questions to ask on a first date?",
    "How do I make a cup of green tea?",
    "What should I name my new puppy?",
    "Describe a perfect summer day in three sentences.",
    "What is a good gift for someone who likes cooking?",
    "How do I say thank you in Japanese?",
    "What is the best way to learn to play the guitar?",
    "Plan a simple dinner menu for four people.",
    "Why do cats purr?",
)


def chat_prompt_ids(model_path: Path, questions: tuple[str, ...] = QUESTIONS) -> list[list[int]]:
    """Each question as one user turn in the model's chat template, with the assistant's turn opened: token ids."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    return [list(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                         tokenize=True, return_dict=True)["input_ids"]) for q in questions]


def eos_token_ids(model_path: Path) -> tuple[int, ...]:
    """The ids that end a reply: the generation config's eos_token_id (one or several), else the tokenizer's."""
    import json

    ids: list[int] = []
    gen = model_path / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids = eos if isinstance(eos, list) else [eos] if eos is not None else []
    if not ids:
        from transformers import AutoTokenizer

        ids = [AutoTokenizer.from_pretrained(model_path).eos_token_id]
    return tuple(int(i) for i in ids)


def chat_workload(model_path: Path, decoding: Decoding, max_tokens: int = 256, name: str = "chat") -> Workload:
    """QUESTIONS in the model's template, each reply at most max_tokens and ended by the model's end of turn."""
    prompts = chat_prompt_ids(model_path)
    decoding = Decoding(**{**decoding.__dict__, "stop_at_eos": True, "eos_token_ids": eos_token_ids(model_path)})
    return Workload(name, prompts, [max_tokens] * len(prompts), decoding=decoding)

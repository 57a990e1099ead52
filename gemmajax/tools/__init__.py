"""Text in and out: tokenizer, incremental detokenizer, chat template, Gemma 4 parsers, constrained decoding."""
from gemmajax.tools.parser import Gemma4StreamParser, ParsedMessage, parse_gemma4

__all__ = ["parse_gemma4", "Gemma4StreamParser", "ParsedMessage"]

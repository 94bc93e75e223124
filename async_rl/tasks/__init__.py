"""Built-in tasks: where prompts come from (``PromptSource``) and how they are scored."""

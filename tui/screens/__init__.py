"""The chat app's screens: the chat itself, and the conversation list over it."""

"""What a runner makes of an engine's output, whichever engine serves: chat rendering and tools described in it
(`chat`), the reasoning split from the answer (`reasoning`), tool calls parsed (`toolcalls`), stop strings
(`textstream`), JSON constrained (`constrained`) and closed (`json_closer`), and the chunks a task's output
becomes (`output`)."""
